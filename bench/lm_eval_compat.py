"""lm-eval-harness against a running server, through its own `local-completions` client (lm_eval.models.
openai_completions.LocalCompletionsAPI), checked against TPEngine in this process on the same model.

    pip install lm_eval        # (not a tpgraph dependency: a check of what an evaluation run sends)
    torchrun --nproc-per-node 2 -m tpgraph.serve --device cpu --max-model-len 256 --port 8011 &
    python bench/lm_eval_compat.py --url http://127.0.0.1:8011 --device cpu --max-model-len 256

The client finds the server's /tokenizer_info and /tokenize (its remote tokenizer: no tokenizer of its own), scores
loglikelihood requests with `echo` + `logprobs` (the prompt tokens' log-probabilities) and runs generate_until
requests. Each answer must equal TPEngine's: the continuation's summed prompt log-probability (within 1e-3) and
whether it is the greedy one, and the greedy text up to the stop string. Prints a table and exits non-zero on a
mismatch."""

from __future__ import annotations

import argparse
import sys

# (the fifth: the built-in model's own greedy continuation; the last: an empty context, which lm-eval replaces by the
# BOS the server's /tokenizer_info names)
CASES = [("The quick brown fox", " jumps over"), ("Hello, ", "world"), ("a" * 40, "aaaa"), ("tpgraph ", "is"),
         ("Once upon a time", "eeee"), ("", "Hello")]
GENERATE = [("Once upon a time", {"until": ["\n"], "max_gen_toks": 12}), ("1, 2, 3,", {"until": ["9"],
                                                                                     "max_gen_toks": 8})]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8011")
    p.add_argument("--model", default="tpgraph-builtin", help="the name it serves")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-model-len", type=int, default=256)
    args = p.parse_args()

    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from tpgraph import SamplingParams, TPEngine

    lm = LocalCompletionsAPI(base_url=f"{args.url}/v1/completions", model=args.model, tokenizer_backend="auto",
                             max_length=args.max_model_len, num_concurrent=2)
    remote = type(lm.tokenizer).__name__
    scored = lm.loglikelihood([Instance("loglikelihood", {}, case, i) for i, case in enumerate(CASES)])
    generated = lm.generate_until([Instance("generate_until", {}, case, i) for i, case in enumerate(GENERATE)])

    failures = 0
    with TPEngine(device=args.device, max_model_len=args.max_model_len) as engine:
        def ids(text: str) -> list[int]:  # as lm-eval tokenizes: no special tokens (its add_bos_token is off)
            return engine.prompts.encode_text(text, add_special_tokens=False)

        print(f"lm-eval's tokenizer: {remote}")
        print("| context | continuation | lm-eval log p | TPEngine log p | greedy (lm-eval / TPEngine) |")
        print("|---|---|---|---|---|")
        for (context, continuation), (logp, greedy) in zip(CASES, scored, strict=True):
            # as lm-eval's _encode_pair: a context's trailing spaces move on, the whole is encoded and then split;
            # an empty context is the BOS alone
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if context:
                ctx, whole = ids(context), ids(context + continuation)
            else:
                ctx = [engine.tokenizer.token_to_id(engine.prompts.tokenizer_info(args.max_model_len)["bos_token"])]
                whole = ctx + ids(continuation)
            out = engine.generate([whole], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                                  use_tqdm=False)[0]
            tail = range(len(ctx), len(whole))
            want = sum(out.prompt_logprobs[j][whole[j]].logprob for j in tail)
            want_greedy = all(out.prompt_logprobs[j][whole[j]].rank == 1 for j in tail)  # (the top one's rank is 1)
            ok = abs(logp - want) < 1e-3 and greedy == want_greedy
            failures += not ok
            print(f"| {context[:20]!r} | {continuation!r} | {logp:.4f} | {want:.4f} | {greedy} / {want_greedy}"
                  f"{'' if ok else ' MISMATCH'} |")
        print("\n| context | until | lm-eval text | TPEngine text |")
        print("|---|---|---|---|")
        for (context, kw), text in zip(GENERATE, generated, strict=True):
            out = engine.generate([ids(context)], SamplingParams(temperature=0.0, max_tokens=kw["max_gen_toks"],
                                                                 stop=kw["until"]), use_tqdm=False)[0].outputs[0].text
            ok = text == out
            failures += not ok
            print(f"| {context!r} | {kw['until']} | {text!r} | {out!r}{'' if ok else ' MISMATCH'} |")
    print(f"\n{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
