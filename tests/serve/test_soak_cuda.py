"""The server soak on a GPU: 2,000 concurrent requests (INGOT_SOAK_REQUESTS) of mixed lengths
against `ingot serve` on CUDA, a quarter of them constrained (structured outputs), a fifth of
the clients leaving at random points; every finished constrained answer follows its grammar.

The reference is the offline engine on the same GPU, in fp32. A GPU step's floating-point
results depend on its batch (which kernels and GEMM algorithms run), so a token where two
candidates tie to the last bits may differ; an answer passes when it equals the reference
up to the first difference and, there, each side's token is among the other's top-5
logprobs (the criterion vLLM's tests use against HF).
"""

from __future__ import annotations

import gc
import os

import httpx
import pytest
import torch

from ingot import LLM, SamplingParams
from tests.serve.server_process import running_server, wait_until
from tests.serve.soak import Answer, close_to, make_jobs, run_clients, valid

KEY = "soak-key"
TOP = 5
DEVICE = "cuda"


def reference(jobs: list, device: str) -> list[tuple[list[str], list[dict[str, float]]]]:
    """Each job's greedy tokens and top logprobs from the offline engine (a third of the GPU's
    memory, so that the server finds room even before this engine's is released)."""
    with LLM(device=device, dtype="float32", show_progress=False, gpu_memory_utilization=0.3) as offline:
        outs = offline.generate([j.prompt for j in jobs],
                                [SamplingParams(temperature=0.0, max_tokens=j.max_tokens, logprobs=TOP,
                                                structured_outputs=j.structured_outputs()) for j in jobs],
                                use_tqdm=False)
    expected = []
    for out in outs:
        c = out.outputs[0]
        tokens = [pos[t].decoded_token for t, pos in zip(c.token_ids, c.logprobs)]
        top = [{lp.decoded_token: lp.logprob for lp in pos.values() if lp.rank is not None and lp.rank <= TOP}
               for pos in c.logprobs]
        expected.append((tokens, top))
    return expected


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_soak_on_the_gpu(smollm2_gguf):
    jobs = make_jobs(int(os.environ.get("INGOT_SOAK_REQUESTS", "2000")), constrained=0.25)
    expected = reference(jobs, DEVICE)
    gc.collect()
    torch.cuda.empty_cache()

    with running_server("--device", DEVICE, "--dtype", "float32", "--api-key", KEY, "--served-model-name", "smol",
                        "--quiet") as srv:
        results = run_clients(srv.v1, KEY, "smol", jobs, logprobs=TOP)
        kept = [i for i, r in enumerate(results) if r != "left"]
        assert len(kept) > 0.65 * len(jobs)
        failures = [f"{i}: {r!r}" for i, r in enumerate(results) if i in kept and not isinstance(r, Answer)]
        failures += [f"{i}: {why}" for i in kept if isinstance(results[i], Answer)
                     for why in [close_to(results[i], *expected[i])] if why]
        failures += [f"{i}: {results[i].text!r} breaks {jobs[i].constraint}" for i in kept
                     if isinstance(results[i], Answer) and jobs[i].constraint is not None
                     and results[i].finish_reason == "stop" and not valid(jobs[i], results[i].text)]
        assert not failures, f"{len(failures)} of {len(kept)} answers differ: " + "; ".join(failures[:5])

        def idle() -> bool:
            text = httpx.get(srv.url + "/metrics").text
            return "ingot:num_requests_running{" in text and all(
                float(line.rsplit(" ", 1)[1]) == 0 for line in text.splitlines()
                if line.startswith(("ingot:num_requests_running", "ingot:num_requests_waiting", "ingot:kv_cache_usage_perc")))

        assert wait_until(idle, 60)
        assert httpx.get(srv.url + "/health").status_code == 200
    assert srv.proc.returncode == 0, "".join(srv.log[-20:])
