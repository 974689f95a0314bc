"""The environments that come with clotho, each one module written against the Environment API
(`environments.base`) exactly as an outside author would write theirs: single-turn over a list of
items (capitals), procedural (arithmetic, compare, reasoning_gym), multi-turn (guess_number,
tool_use), multi-agent (group_chat), code run in a sandbox (code_exec), a model as judge
(llm_judge), a base model with no chat template (continuation), demonstrations (sft) and
distillation (distill). Each is installed under its short name (`clotho env list`)."""
