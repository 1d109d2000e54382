"""`tokenforge bench serve`'s entry (serve.py's flags and load), and W4 with speculative decoding
at a chosen acceptance: `bench serve --replay-acceptance A`.

    tokenforge bench serve --launch "--model llama-3.1-8b --load-format dummy --speculative-method ngram \
        --num-speculative-tokens 4" --replay-acceptance 0.8 --request-rate 1 --num-prompts 30

On dummy weights no real drafter agrees with the target, so the launched server's n-gram method
gets the replay drafter in its place, and both servers draw dummy weights on which greedy decoding
does not depend on the batch (TOKENFORGE_STABLE_DUMMY: on plain ones a served load's changing batches
round near-tie logits differently each pass, and the learnt path is not the one taken: acceptance
0.017 where 0.8 was asked, H100, wave 3 round 11) (bench/lib/replay.py `LearningReplay`, named to the server by
TOKENFORGE_DRAFT_PROPOSER): every pass of the load uses the same seed, so the same prompts and
arrivals; the first `--replay-passes` passes (untimed) teach the drafter each request's greedy
path, then the timed pass proposes it back with each token kept with probability A. The same load
then runs against a server started with the same flags less the speculative ones. Out: both
summaries, the TPOT p50 ratio (issue: at 1 req/s at least 2x lower with speculation) and the
acceptance the timed pass measured (the replay's keep rate, from the server's /metrics).
"""

from __future__ import annotations

import argparse
import re
import shlex

import httpx

from tokenforge import envs
from tokenforge.bench.lib.replay import ReplayDrafter, keep_rate
from tokenforge.bench.lib.serve_floor import flag
from tokenforge.bench.serving import serve

SPEC_FLAGS = ("--speculative-method", "--num-speculative-tokens", "--ngram-min", "--ngram-max")


def without_flags(words: list[str], names: tuple[str, ...]) -> list[str]:
    """`words` less each `--name V` / `--name=V` among `names`."""
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        key, eq, _ = word.partition("=")
        if key in names:
            skip = not eq
            continue
        out.append(word)
    return out


def spec_counters(url: str, api_key: str | None = None) -> dict:
    """The server's speculative counters: drafts verified, draft tokens, accepted, per position."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_position": {}}
    for line in text.splitlines():
        if not line.startswith("tokenforge:spec_decode_num_"):
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        name = name.removeprefix("tokenforge:spec_decode_").removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', line).group(1))
            out["per_position"][pos] = out["per_position"].get(pos, 0.0) + value
        elif name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += value
    return out


def counters_between(before: dict, after: dict) -> dict:
    width = max([*before["per_position"], *after["per_position"], -1]) + 1
    per_pos = [after["per_position"].get(i, 0.0) - before["per_position"].get(i, 0.0) for i in range(width)]
    stats = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return {**stats, "accepted_per_position": per_pos,
            "acceptance_rate": stats["num_accepted_tokens"] / stats["num_draft_tokens"] if stats["num_draft_tokens"] else None,
            "mean_acceptance_length": 1 + stats["num_accepted_tokens"] / stats["num_drafts"] if stats["num_drafts"] else None}


def add_args(p: argparse.ArgumentParser) -> None:
    serve.add_args(p)
    g = p.add_argument_group("served speculation (replay drafter)")
    g.add_argument("--replay-acceptance", type=float, default=None, metavar="A",
                   help="with --launch ... --speculative-method ngram: the replay drafter in the server's n-gram "
                        "method, each token kept with probability A, against the same load without speculation")
    g.add_argument("--replay-passes", type=int, default=2,
                   help="untimed passes of the load that teach the replay drafter (default %(default)s)")


def main(args: argparse.Namespace) -> dict:
    if getattr(args, "replay_acceptance", None) is None:
        return serve.main(args)
    return run_speculative(args, serve._ceilings(args))


def run_speculative(args: argparse.Namespace, ceilings: dict | None) -> dict:
    words = shlex.split(getattr(args, "launch", None) or "")
    if flag(words, "--speculative-method") != "ngram":
        raise ValueError("--replay-acceptance replaces the drafts of a launched server's host proposer: give "
                         "--launch with --speculative-method ngram")
    acceptance = args.replay_acceptance
    load = serve.Load.from_args(args)          # one seed: every pass sends the same prompts at the same times
    # dummy weights whose greedy path no batch shape changes (model/loader/dummy_loader.py), in both servers
    stable = {envs.STABLE_DUMMY: "1"}
    env = envs.child_env(**stable, **{envs.DRAFT_PROPOSER: "tokenforge.bench.lib.replay:served_proposer",
                                      envs.REPLAY_ACCEPTANCE: str(acceptance), envs.REPLAY_PROMPT_LEN: str(load.input_len)})
    with serve._launched(shlex.join(words), serve._opt(args, "url"), env=env) as url:
        model = getattr(args, "model", None) or serve.served_model(url, load.api_key)
        for _ in range(args.replay_passes):    # the drafter learns the greedy path, then the verify path's
            serve.run(serve.run_load(url, model, load))
        before = spec_counters(url, load.api_key)
        spec = serve.run(serve.run_load(url, model, load))
        stats = counters_between(before, spec_counters(url, load.api_key))
    with serve._launched(shlex.join(without_flags(words, SPEC_FLAGS)), serve._opt(args, "url"),
                         env=envs.child_env(**stable)) as url:
        base = serve.run(serve.run_load(url, model, load))
    k = int(flag(words, "--num-speculative-tokens") or 4)
    ratio = (base["tpot_ms"]["p50"] / spec["tpot_ms"]["p50"]) if spec["tpot_ms"]["p50"] else None
    result = {"workload": "W4-spec", "launch": args.launch, "flags": serve.launch_flags(args.launch),
              "replay_acceptance": acceptance, "replay_passes": args.replay_passes, "num_speculative_tokens": k,
              "expected_tokens_per_step": ReplayDrafter.expected_tokens_per_step(acceptance, k),
              "speculative": spec, "no_speculation": base, "spec_decode": stats,
              "replay_keep_rate": keep_rate(stats) if stats["num_drafts"] else None,
              "tpot_p50_ratio": ratio, "ceilings": ceilings,
              "floor": serve._floor(args, model, base, ceilings)}
    serve.save_and_print(args, model, result, f"replay-{acceptance:g}-rate-{load.rate:g}")
    print(f"TPOT p50: {base['tpot_ms']['p50']:.2f} ms without speculation, {spec['tpot_ms']['p50']:.2f} with "
          f"(x{ratio:.2f}); acceptance {stats['acceptance_rate']}, keep rate {result['replay_keep_rate']}",
          flush=True)
    return result
