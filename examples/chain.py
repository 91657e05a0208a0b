"""An LCEL chain over specdec-llm: ``prompt | llm | StrOutputParser()`` with invoke, batch, stream.

    python examples/chain.py [--pair NAME] [--max-new-tokens N] [--backend auto|local|remote] [--worker]

On a fresh machine (no SPECDEC_BROKER_URL) the LLM runs in local mode: the pair is loaded
in this process. ``--worker`` starts a local worker and sends the chain's prompts through
the worker pool instead (the embedded broker needs no server); with SPECDEC_BROKER_URL set
the LLM uses the pool anyway. The pair defaults to SPECDEC_DEFAULT_PAIR (smollm2-135m).
"""

from __future__ import annotations

import argparse
import sys
import time

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate

from specdec_llm.langchain import SpecDecLLM
from specdec_llm.pairs import quiet_loading
from specdec_llm.settings import get_settings

TOPICS = ["KV caches", "rejection sampling", "tokenizers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default=None, help="pair name (default: SPECDEC_DEFAULT_PAIR)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--backend", choices=["auto", "local", "remote"], default="auto")
    ap.add_argument("--worker", action="store_true", help="start a local worker and use remote mode")
    args = ap.parse_args(argv)
    quiet_loading()
    pair = args.pair or get_settings().default_pair

    worker = None
    if args.worker:
        from specdec_llm import client

        worker = client.start_local_worker(pair)
        args.backend = "remote"
        print(f"started a local worker for {pair} (log: {worker.log_path})", file=sys.stderr)
    try:
        llm = SpecDecLLM(
            pair=pair,
            chat=True,
            max_new_tokens=args.max_new_tokens,
            backend=args.backend,
            job_name="example-chain",
            timeout=600,
        )
        prompt = PromptTemplate.from_template("In two sentences, explain {topic} to a new software engineer.")
        chain = prompt | llm | StrOutputParser()
        print(f"# pair {pair}, {llm.effective_backend()} mode\n")

        t0 = time.perf_counter()
        print("## invoke\n" + chain.invoke({"topic": "speculative decoding"}).strip())
        print(f"({time.perf_counter() - t0:.1f} s)\n")

        t0 = time.perf_counter()
        answers = chain.batch([{"topic": t} for t in TOPICS])  # one submission for all of them
        print("## batch")
        for topic, answer in zip(TOPICS, answers):
            print(f"- {topic}: {answer.strip()}")
        print(f"({time.perf_counter() - t0:.1f} s)\n")

        t0 = time.perf_counter()
        print("## stream")
        pieces = 0
        for piece in chain.stream({"topic": "draft models"}):
            print(piece, end="", flush=True)
            pieces += 1
        print(f"\n({pieces} pieces, {time.perf_counter() - t0:.1f} s)")
    finally:
        if worker is not None:
            from specdec_llm import client

            client.stop_local_worker(worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
