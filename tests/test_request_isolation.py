"""An error while making one request's output (a detokenizer fault) fails that request only."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from pagellm.core.sched_output import RequestUpdate
from pagellm.engine.output_processor import OutputProcessor
from pagellm.sampling_params import OutputKind, SamplingParams


def test_a_failing_request_leaves_the_others_alone(tiny_llama_dir: Path) -> None:
    processor = OutputProcessor(AutoTokenizer.from_pretrained(str(tiny_llama_dir)))
    for request_id in ("good", "bad"):
        processor.add_request(request_id, None, [1, 2, 3], SamplingParams(max_tokens=4),
                              OutputKind.DELTA, arrival_time=0.0)

    def broken_update(*_: object) -> None:
        raise RuntimeError("detokenizer fault")

    processor.states["bad"].sequences[0].detokenizer.update = broken_update
    updates = [RequestUpdate("good", None, 0, [5], [None]), RequestUpdate("bad", None, 0, [5], [None])]
    failed: dict[str, Exception] = {}
    outputs, _ = processor.process(updates, failed=failed)
    assert [output.request_id for output in outputs] == ["good"]
    assert list(failed) == ["bad"] and str(failed["bad"]) == "detokenizer fault"
    assert processor.has_request("bad")  # still held until the caller aborts it
    assert processor.abort("bad") is not None and not processor.has_request("bad")
    outputs, _ = processor.process([RequestUpdate("good", None, 0, [6], [None], "length")],
                                   failed=failed)
    assert outputs[0].finished and outputs[0].outputs[0].token_ids == [6]
