"""The policy model on packed rows, rank shares of a step, and the published HF checkpoint files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import cached_tiny_model
from trainer.config import LossConfig
from trainer.model import (
    NO_LOGITS,
    enable_gradient_checkpointing,
    gradient_norm,
    hidden_logprobs,
    idle_micro_batch,
    load_policy,
    micro_batch_loss,
    packed_logprobs,
    rank_micro_batches,
    token_logprobs,
)
from trainer.packing import TrainingSequence, pack_micro_batches
from trainer.publishing import published_tensors, save_hf_checkpoint
from trainer.step import ObjectiveShare


def sequence(length: int, seed: int) -> TrainingSequence:
    tokens = torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed))
    return TrainingSequence(
        tokens=tokens.tolist(),
        mask=[False] + [True] * (length - 1),
        old_logprobs=[-1.0] * length,
        advantages=[1.0] * length,
        name=f"sequence {seed}",
    )


@torch.no_grad()
def check_each_scores_as_alone(model, batch, sequences: list[TrainingSequence]) -> torch.Tensor:
    """Every sequence's logprobs in the micro-batch equal its own forward pass; returns the
    micro-batch's logprobs."""
    packed, _ = packed_logprobs(model, batch)
    for index, s in enumerate(sequences):
        ids = torch.tensor([s.tokens])
        alone = token_logprobs(model(input_ids=ids).logits, ids)
        torch.testing.assert_close(packed[batch.sequence_ids == index][1:], alone[0, 1:], atol=2e-6, rtol=0)
    return packed


def test_packed_logprobs_equal_each_sequence_alone(tiny_model_dir):
    # Three sequences sharing rows, kept apart by their bounds (no mask): each must score exactly as
    # it does alone, so neither positions nor attention leak across packed boundaries or rows.
    model = load_policy(str(tiny_model_dir)).eval()
    sequences = [sequence(20, 0), sequence(33, 1), sequence(7, 2)]
    (batch,) = pack_micro_batches(sequences, token_budget=128, padded_rows=False)
    assert batch.shares_rows() and not batch.needs_mask()
    check_each_scores_as_alone(model, batch, sequences)


def test_rows_of_one_sequence_run_without_a_mask_and_score_as_each_sequence_alone(tiny_model_dir):
    # One sequence a row, padded at the end (where slots cost the most, the padded batch of alike
    # lengths saves the rows' padding): no mask, no position ids (sdpa's causal kernel).
    model = load_policy(str(tiny_model_dir)).eval()
    sequences = [sequence(33, 0), sequence(33, 1), sequence(33, 2)]
    (batch,) = pack_micro_batches(sequences, token_budget=128, token_work=6 * 64)
    assert batch.input_ids.shape == (len(sequences), 33) and not batch.shares_rows() and not batch.needs_mask()
    check_each_scores_as_alone(model, batch, sequences)


def test_ranks_share_micro_batches_and_pad_with_idle_ones(tiny_model_dir):
    batches = pack_micro_batches([sequence(40, i) for i in range(3)], token_budget=64)
    assert len(batches) == 3
    first, second = rank_micro_batches(batches, 0, 2), rank_micro_batches(batches, 1, 2)
    assert [b.num_trained_tokens for b in first] == [39, 39]
    assert [b.num_trained_tokens for b in second] == [39, 0]
    assert rank_micro_batches(batches, 0, 1) == batches

    # An idle micro-batch still runs the whole model, with a zero loss and zero gradients.
    model = load_policy(str(tiny_model_dir))
    loss, metrics = micro_batch_loss(model, idle_micro_batch(), LossConfig(), objectives={})
    loss.backward()
    assert loss.item() == 0.0 and metrics == {}
    assert all(p.grad is not None for p in model.parameters())
    assert gradient_norm(model) == 0.0


def test_tied_checkpoint_stores_lm_head_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = cached_tiny_model(tie_embeddings=True)
    model = load_policy(str(source))
    with torch.no_grad():  # a trained-looking change, so the test cannot pass on the base files
        model.model.embed_tokens.weight.mul_(1.5)
    save_hf_checkpoint(model, published_tensors(model, model.state_dict(), None), str(source), tmp_path)

    tensors = load_file(tmp_path / "model.safetensors")
    torch.testing.assert_close(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.config.tie_word_embeddings
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert AutoTokenizer.from_pretrained(tmp_path).vocab_size == AutoTokenizer.from_pretrained(source).vocab_size
    assert (tmp_path / "generation_config.json").exists()


class RecordingHead(torch.nn.Module):
    """The model's LM head, recording how many positions each call scores (forward and recompute)."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.head, self.calls, self.out_features = head, [], head.out_features

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.calls.append(features.shape[0])
        return self.head(features)


def test_chunked_logprobs_equal_the_whole_logits_with_gradients(tiny_model_dir):
    # Three rows at per-position temperatures, with a shared-prefix predictor map: the chunked
    # path (7 positions a chunk, the last one ragged) gives the whole-logits logprobs, entropies
    # and parameter gradients, and never scores more than one chunk of positions at once.
    model = load_policy(str(tiny_model_dir)).train()
    ids = torch.randint(3, 512, (3, 23), generator=torch.Generator().manual_seed(5))
    temperature = torch.rand(3, 23, generator=torch.Generator().manual_seed(6)) + 0.5
    predictors = torch.arange(23).expand(3, -1) - 1
    predictors[1, 10:] = torch.arange(2, 15)  # row 1's tokens 10.. continue from position 2
    upstream = torch.randn(3, 23, generator=torch.Generator().manual_seed(7))

    def gradients(logprobs):
        model.zero_grad()
        (logprobs * upstream).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    logits = model(input_ids=ids).logits
    whole = token_logprobs(logits, ids, temperature, predictors=predictors)
    expected_gradients = gradients(whole)
    rows = torch.arange(3)[:, None]
    scaled = (logits.detach()[rows, predictors[:, 1:]] / temperature[rows, predictors[:, 1:]][..., None]).log_softmax(
        -1
    )
    expected_entropy = -(scaled.exp() * scaled).sum(-1)

    head = RecordingHead(model.get_output_embeddings())
    hidden = model(input_ids=ids, logits_to_keep=NO_LOGITS, output_hidden_states=True).hidden_states[-1]
    chunked, entropy = hidden_logprobs(hidden, head, ids, temperature, predictors=predictors, chunk_bytes=7 * 4 * 512)
    torch.testing.assert_close(chunked, whole, atol=2e-6, rtol=0)
    torch.testing.assert_close(entropy[:, 1:], expected_entropy, atol=2e-5, rtol=0)
    assert not entropy.requires_grad and (entropy[:, 0] == 0).all()
    for name, grad in gradients(chunked).items():
        torch.testing.assert_close(grad, expected_gradients[name], atol=1e-6, rtol=1e-4, msg=name)
    # 66 positions in chunks of 7: 10 calls forward, 10 again in the backward (checkpointed).
    assert max(head.calls) == 7 and len(head.calls) == 20 and sum(head.calls) == 2 * 66


def test_gradient_checkpointing_recomputes_layers_for_the_same_gradients(tiny_model_dir):
    sequences = [sequence(30, 0), sequence(17, 1), sequence(25, 2)]
    (batch,) = pack_micro_batches(sequences, token_budget=128, padded_rows=False)
    objectives = {"rl": ObjectiveShare(groups=1, num_sequences=3, num_trained_tokens=69, weight=1.0)}

    def gradients(model):
        loss, _ = micro_batch_loss(model, batch, LossConfig(), objectives=objectives)
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain = load_policy(str(tiny_model_dir))
    expected = gradients(plain)
    model = load_policy(str(tiny_model_dir))
    enable_gradient_checkpointing(model)
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    got = gradients(model)
    assert len(calls) == 2  # the forward, and its recompute in the backward
    assert not model.training and not model.model.layers[0].self_attn.training  # dropout stays off
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-7, rtol=1e-5, msg=name)


def test_a_checkpoint_published_in_bf16_holds_bf16_weights_and_says_so(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    source = cached_tiny_model(tie_embeddings=True)
    model = load_policy(str(source))
    save_hf_checkpoint(
        model, published_tensors(model, model.state_dict(), torch.bfloat16), str(source), tmp_path, torch.bfloat16
    )
    tensors = load_file(tmp_path / "model.safetensors")
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    for name, tensor in model.state_dict().items():  # each weight rounded once, nothing else
        torch.testing.assert_close(tensors[name], tensor.to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"], atol=0, rtol=0)
    assert model.dtype == torch.float32 and model.config.dtype == torch.float32  # the trainer's own copy untouched
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16


def test_a_publish_casts_into_the_one_copy_the_publisher_keeps_on_disk_and_its_delta_rebuilds_it(tmp_path):
    """Each publish's bf16 weights are cast a chunk at a time into the file that holds the previous
    publish's, as the delta XORs them (the tied head cast once, `same_as` in the delta): one copy
    kept, outside the trainer's own memory and unlinked, and the deltas rebuild each step byte for
    byte."""
    import os

    from storage import weight_delta
    from trainer.publishing import DeltaPublisher

    model = load_policy(str(cached_tiny_model(tie_embeddings=True)))
    publisher = DeltaPublisher(full_every=10, directory=tmp_path / "staging")
    (tmp_path / "staging").mkdir()

    def write(tensors, path) -> None:
        weight_delta.write_safetensors({name: cast.entry() for name, cast in tensors.items()}, path)

    files, deltas = set(), []
    for step in range(1, 5):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter.abs() * 2**-6)  # past bf16's spacing: the bytes change
        tensors = published_tensors(model, model.state_dict(), torch.bfloat16)
        assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]
        encoded = publisher.publishing(tensors)
        kept = publisher.kept
        assert kept["lm_head.weight"] == kept["model.embed_tokens.weight"]
        for name, tensor in model.state_dict().items():
            region = kept[name]
            stored = os.pread(region.file, region.nbytes, region.offset)
            assert stored == tensor.to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes(), name
        files.add(os.fstat(publisher.file.fileno()).st_ino)
        if step == 1:
            assert encoded is None
            write(tensors, tmp_path / "base.safetensors")
        else:
            assert encoded is not None and encoded[1] == list(range(1, step))
            deltas.append((step, encoded[0]))
        publisher.published(step, encoded[1] if encoded else [])
    assert len(files) == 1 and list((tmp_path / "staging").iterdir()) == []  # one file, in no directory
    header = weight_delta.read_delta(deltas[0][1], "delta")[0]
    assert header["tensors"]["lm_head.weight"]["same_as"] == "model.embed_tokens.weight"
    write(tensors, tmp_path / "expected.safetensors")
    weight_delta.apply(tmp_path / "base.safetensors", deltas, tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


def test_rows_shared_by_sequences_attend_by_their_bounds_without_a_mask(tiny_model_dir, monkeypatch):
    """Several sequences a row, no hook: variable-length attention over their boundaries (each
    row's padding a segment of its own), no dense mask built; the same logprobs as each sequence
    alone and the same gradients as the dense mask."""
    from trainer.packing import PackedBatch

    model = load_policy(str(tiny_model_dir)).eval()
    sequences = [sequence(20, 0), sequence(13, 1), sequence(7, 2), sequence(30, 3)]
    (batch,) = pack_micro_batches(sequences, token_budget=96, padded_rows=False)
    assert batch.shares_rows() and not batch.needs_mask()
    bounds, longest = batch.sequence_bounds()
    rows, length = batch.input_ids.shape
    assert bounds[0] == 0 and bounds[-1] == rows * length and longest == 30
    assert len(bounds) - 1 == len(sequences) + int((batch.sequence_ids == -1).any(dim=1).sum())
    dense = batch.attention_mask()
    monkeypatch.setattr(PackedBatch, "attention_mask", lambda *a, **k: pytest.fail("built the dense mask"))
    check_each_scores_as_alone(model, batch, sequences)

    def gradients(**inputs) -> list[torch.Tensor]:
        model.zero_grad()
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **inputs).logits
        (token_logprobs(logits, batch.input_ids) * batch.mask).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    by_bounds = gradients(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
    for ours, theirs in zip(by_bounds, gradients(attention_mask=dense), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_a_bf16_publish_parity_reference_is_of_the_rounded_weights(tmp_path):
    """The reference a server is checked against is the logprobs of what it loads (the weights
    rounded to bf16, computed in bf16), computed without a second model, and leaves the trainer's
    model as it was: its fp32 parameters, and its decoder layers' training flag (gradient
    checkpointing)."""
    from inference.parity import model_logprobs, read_parity_reference, write_parity_reference

    source = cached_tiny_model(tie_embeddings=True)
    model = load_policy(str(source))
    enable_gradient_checkpointing(model)
    # Shift every weight by less than bf16's spacing: fp32 logprobs move, the rounded weights do not.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(parameter.abs() * 2**-10)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tensors = published_tensors(model, model.state_dict(), torch.bfloat16)
    save_hf_checkpoint(model, tensors, str(source), tmp_path, torch.bfloat16)
    sequences = [[5, 9, 17, 33, 2, 8], [7, 7, 100, 3]]
    write_parity_reference(model, sequences, tmp_path, torch.bfloat16)

    # The published bf16 weights, upcast: every parameter already a bf16 value, the norms' included.
    loaded = load_policy(str(tmp_path)).float()
    _, stored = read_parity_reference(tmp_path)
    assert model_logprobs(loaded, sequences, torch.bfloat16) == stored
    assert model_logprobs(model, sequences, torch.bfloat16) == stored  # computing it again changes nothing
    with torch.no_grad():  # weights moved by more than the rounding give other logprobs
        for parameter in loaded.parameters():
            parameter.add_(parameter.abs() * 2**-6)
    assert model_logprobs(loaded, sequences, torch.bfloat16) != stored
    fp32 = model_logprobs(model, sequences)
    assert max(abs(a - b) for s, r in zip(fp32, stored) for a, b in zip(s, r)) > 1e-4  # the shift is seen in fp32
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and torch.equal(parameter, before[name]), name
    assert not model.training and model.model.layers[0].training and not model.model.layers[0].self_attn.training


def test_gradient_checkpointing_is_on_by_default_for_real_models_only(tiny_tokenizer):
    """The default (gradient_checkpointing None) from the model's shape and micro_batch_tokens: the
    real shapes at 4,096 tokens would keep gigabytes of activations, the small ones megabytes."""
    from inference.tiny_model import model_config
    from trainer.model import ACTIVATION_BUDGET_BYTES, activation_bytes, wants_gradient_checkpointing

    wanted = {
        size: wants_gradient_checkpointing(model_config(size, tiny_tokenizer)[0], 4096)
        for size in ("tiny", "small", "smollm2-135m", "qwen2.5-0.5b")
    }
    assert wanted == {"tiny": False, "small": False, "smollm2-135m": True, "qwen2.5-0.5b": True}
    half_b = model_config("qwen2.5-0.5b", tiny_tokenizer)[0]
    assert activation_bytes(half_b, 8192) > 15 * 2**30  # past what the first run without it reached
    assert not wants_gradient_checkpointing(model_config("smollm2-135m", tiny_tokenizer)[0], 256)
    assert activation_bytes(half_b, 1) * 4096 == activation_bytes(half_b, 4096) > ACTIVATION_BUDGET_BYTES
