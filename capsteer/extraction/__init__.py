"""Extraction jobs: prompts in, a resumable `sharded` activation dataset out (api.md §5).

job.py      the input format, ids, the job's worker config and the resume checks
submit.py   how a record becomes a capture request on an in-process engine
local.py    the single-engine runner and `extract`, the Python entry point
commit.py   the job directory under Ray: replicas stage, the driver commits
ray.py      the Ray Data runner (N engine replicas; Ray is optional)
cli.py      `capsteer extract`'s flags and its one-line refusals
"""
