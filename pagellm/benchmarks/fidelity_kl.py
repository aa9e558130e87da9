"""The KL divergence column of `pagellm bench fidelity`: how far an engine's next-token
distribution is from the exact model's, per token, on the exact model's own continuations.

Both sides are teacher-forced on the same text (each rendered prompt followed by the exact
model's greedy answer), so every variant is judged on identical contexts whatever it
would have generated. The exact side is transformers' full float32 distribution. The
engine side is its prompt logprobs, which carry the top 20 tokens and the text's own token
at each position. The divergence is taken over the partition {those tokens, everything
else}: KL(exact || engine) of the two distributions coarsened to that partition. By the
data-processing inequality it never exceeds the full-vocabulary KL, and it equals it when
the tokens outside the engine's top 20 carry negligible mass, as they do after a confident
position.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TOP_LOGPROBS = 20
_FLOOR = 1e-12  # a rest-of-vocabulary mass that rounding took to zero or below


def exact_logprobs(model: Any, prompts: list[list[int]],
                   answers: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-probabilities over the whole vocabulary at each answer position:
    row i is the distribution that predicts answers[k][i]."""
    rows = []
    with torch.inference_mode():
        for prompt, answer in zip(prompts, answers):
            ids = torch.tensor([prompt + answer])
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            start = len(prompt) - 1
            rows.append(torch.log_softmax(logits[start:start + len(answer)], dim=-1))
    return rows


def engine_logprobs(llm: Any, prompts: list[list[int]],
                    answers: list[list[int]]) -> list[list[dict[int, float]]]:
    """The engine's prompt logprobs at the same positions: for each answer token, the top
    tokens of the distribution that predicts it (and the token itself)."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS)
    outputs = llm.generate([p + a for p, a in zip(prompts, answers)], params, use_tqdm=False)
    known = []
    for prompt, answer, output in zip(prompts, answers, outputs):
        rows = output.prompt_logprobs[len(prompt):len(prompt) + len(answer)]
        known.append([{token: lp.logprob for token, lp in row.items()} for row in rows])
    return known


def coarse_kl(exact: torch.Tensor, engine: dict[int, float]) -> float:
    """KL(exact || engine) over {the engine's known tokens, the rest of the vocabulary}."""
    tokens = torch.tensor(list(engine))
    p = exact.double()[tokens].exp()
    q = torch.tensor(list(engine.values()), dtype=torch.float64).exp()
    divergence = float((p * (p.log() - q.log())).sum())
    p_rest = max(1.0 - float(p.sum()), _FLOOR)
    q_rest = max(1.0 - float(q.sum()), _FLOOR)
    # never below 0 but for rounding (the engine's logprobs are float32): report 0 then
    return max(0.0, divergence + p_rest * math.log(p_rest / q_rest))


def mean_kl(exact: list[torch.Tensor], engine: list[list[dict[int, float]]]) -> float:
    """The mean over every answer token of every prompt."""
    values = [coarse_kl(row, known) for rows, knowns in zip(exact, engine)
              for row, known in zip(rows, knowns)]
    return sum(values) / len(values) if values else float("nan")
