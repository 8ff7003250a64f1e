"""How a job's record becomes a capture request on an in-process engine.

Both runners (local.py's loop and ray.py's replicas) feed vLLM the same way: chat
messages are templated into token ids, and each request carries a signed sharded-capture
payload naming its record id, so the worker indexes its rows under that id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from capsteer.capture.spec import CaptureSpec
from capsteer.engine import Engine, needs_end_report
from capsteer.engine_ext.payload import EXTRA_ARGS_KEY, new_capture_id, sign_payload
from capsteer.extraction.job import Record


def engine_prompts(engine: Engine, records: list[Record]) -> Iterator[tuple[Record, dict]]:
    """(record, vLLM prompt) pairs: chat messages templated with the model's tokenizer."""
    for rec in records:
        if rec.messages is not None:
            ids = engine.tokenizer.apply_chat_template(
                rec.messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # newer tokenizers return a BatchEncoding
                ids = ids["input_ids"]
            yield rec, {"prompt_token_ids": list(ids)}
        else:
            yield rec, {"prompt": rec.prompt}


def submit_capture(llm_engine: Any, rec: Record, prompt: dict[str, Any], spec: CaptureSpec,
                   spec_text: str, max_tokens: int) -> tuple[str, bool]:
    """Hand one record to vLLM as a sharded capture request (the in-process and the Ray
    driver loops both submit this way). Returns its capture id, which is also the request
    id its outputs carry, and whether the workers wait for its end report: a prompt-only
    capture closes in the worker, so it gets none."""
    # Start-up cost: Ray's read tasks import this module too and never run an engine.
    from vllm import SamplingParams

    capture_id = new_capture_id()
    ids = prompt.get("prompt_token_ids")
    reports = needs_end_report(spec, None if ids is None else len(ids))
    payload = {"capture": spec_text, "capture_id": capture_id, "sink": "sharded",
               "record_id": rec.id, "await_end": reports}
    prompt["cache_salt"] = f"capsteer-capture-{capture_id}"  # every position is fed
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            extra_args={EXTRA_ARGS_KEY: sign_payload(payload)})
    # outputs carry the id given here; add_request returns vLLM's internal one
    llm_engine.add_request(capture_id, prompt, params)
    return capture_id, reports

