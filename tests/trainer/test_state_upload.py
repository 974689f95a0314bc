"""A resume state on its way to the run's storage does not hold up the steps: the trainer saves it
to its disk, goes on, and commits it in storage once every rank's copy is up; the last one before
it returns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer.rollouts import sampled_groups, write_shards
from tests.trainer.test_train import REPO, environment

UPLOAD_S = 5.0  # a remote store's upload of a real model's state takes minutes; this one takes 5 s

# The trainer in a process of its own (DeepSpeed keeps its process groups per process), its store's
# uploads slowed down; what each step saw of the store, as JSON.
DRIVER = """
import json, sys, time
from trainer.config import TrainerConfig
from trainer.state_store import StateStore
from trainer.train import train

root, model, work, upload_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
upload = StateStore.upload
def slow_upload(self, tag_dir, rank):
    time.sleep(upload_s)
    return upload(self, tag_dir, rank)
StateStore.upload = slow_upload
config = TrainerConfig.from_yaml(None, [f"model={model}", "steps=4", "groups_per_step=2", "lr=1e-3", "max_lag=100",
                                        "save_every=1", "state_every=2", "state_in_storage=true"])
store = StateStore(root, "run")
seen = [{"metrics": m, "stored": store.latest()} for m in train(config, root, "run", work_dir=work, data_timeout_s=60)]
print("SEEN " + json.dumps({"steps": seen, "stored_after": store.latest()}))
"""


@pytest.mark.slow
@pytest.mark.integration
def test_the_resume_state_is_uploaded_beside_the_steps_after_it(tmp_path, tiny_model_dir):
    root = str(tmp_path / "storage")
    write_shards(root, "run", sampled_groups(tiny_model_dir, 8, seed=5), groups_per_shard=2)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, root, str(tiny_model_dir), str(tmp_path / "work"), str(UPLOAD_S)],
        cwd=REPO,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SEEN "))[5:])
    step_2, step_4 = seen["steps"][1], seen["steps"][3]
    # Step 2 saved its state to disk and returned while its upload was under way.
    assert (
        step_2["metrics"]["save_state_s"] < UPLOAD_S
        and step_2["stored"] is None
        and "state_upload_s" not in step_2["metrics"]
    )
    # Step 4's state waits for step 2's to be committed (one upload at a time), then goes up beside
    # the end of the run, which commits it.
    assert step_4["metrics"]["state_upload_s"] >= UPLOAD_S
    assert (tmp_path / "storage" / "run" / "trainer-state" / "step-00000002" / "COMPLETE").exists()
    assert seen["stored_after"][0] == "step-00000004"
    assert sorted(p.name for p in (tmp_path / "work" / "state").glob("step-*")) == ["step-00000002", "step-00000004"]
