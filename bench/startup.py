"""One start-up, timed, in the fresh interpreter `specrt bench load` starts:

    python -m specrt.bench.startup '{"bundle": ..., "options": {...}, "prompt": ...}'

prints one JSON line: import_s (`from specrt.runtime.pipeline import Pipeline`, what `from specrt import Pipeline`
imports), load_s (`Pipeline.load`), first_token_s (`generate` of one new token), rss_mb after it, and the token."""

import time

T0 = time.perf_counter()  # before anything of specrt's is imported but the light package __init__s

import json  # noqa: E402
import sys  # noqa: E402


def main(spec: dict) -> dict:
    from specrt.runtime.pipeline import Pipeline

    t1 = time.perf_counter()
    pipe = Pipeline.load(spec["bundle"], **spec["options"])
    t2 = time.perf_counter()
    out = pipe.generate(spec["prompt"], method="autoregressive", max_new_tokens=1)
    t3 = time.perf_counter()
    from specrt.bench.soak import rss_mb

    return {"import_s": t1 - T0, "load_s": t2 - t1, "first_token_s": t3 - t2, "rss_mb": rss_mb(), "token": out.token_ids}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
