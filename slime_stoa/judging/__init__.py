"""Judging what a worker uploaded, trusting none of it: the primitives the trainer's consumer
(train records) and the evaluation collector (eval records) share.

`signature` (the worker signature against the run's registry), `signers` (the registry, as last
read), `scoring` (the trainer's own rewards from the decoded text and the label; the expected
prompt), `run_data` (the task split and tokenizer from the bucket). Imports only
`slime_stoa.protocol` and `slime_stoa.tasks`; free of torch and slime.
"""
