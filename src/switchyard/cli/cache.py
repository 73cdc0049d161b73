"""`switchyard cache ...`: invalidate a running gateway's response cache (over the admin
API: the cache lives in the gateway), calibrate its threshold, build its verifiers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def cmd_cache(args: argparse.Namespace) -> int:
    """cache invalidate (over the admin API: the cache lives in the gateway) | calibrate."""
    if args.action == "train-verifier":
        from switchyard.config import CacheConfig
        from switchyard.decide import pair_model
        from switchyard.decide.calibrate import load_pairs, minilm_embed, similarities_for

        embed = minilm_embed()
        pairs = [p for path in args.pairs for p in load_pairs(path)]
        sims = similarities_for(pairs, embed)
        threshold = CacheConfig().threshold if args.threshold is None else args.threshold
        model, report = pair_model.train(pairs, sims, threshold, args.max_false_hit_rate)
        out = Path(args.out) if args.out else pair_model.MODEL_FILE
        out.write_text(model.to_json(" + ".join(args.pairs), report) + "\n")
        print(f"{len(pairs)} pairs; {report}; written: {out}")
        return 0
    if args.action == "build-verifier":
        from switchyard.config import CacheConfig, EmbeddingsConfig
        from switchyard.decide import pair_encoder
        from switchyard.embed import cache_dir

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        for name in ("root", "onnxruntime"):  # the quantiser logs every tensor
            logging.getLogger(name).setLevel(logging.WARNING)
        cfg = CacheConfig()
        threshold = cfg.threshold if args.threshold is None else args.threshold
        try:
            path, manifest, built = pair_encoder.build(
                Path(args.dir) if args.dir else cache_dir(EmbeddingsConfig()),
                threshold,
                force=args.force,
                recut=args.recut,
                data_dir=Path(args.data_dir) if args.data_dir else None,
            )
        except pair_encoder.EncoderMissing as exc:
            print(f"switchyard: {exc}", file=sys.stderr)
            return 1
        chain = pair_encoder.chain_name(cfg.verify, cfg.verify_model)
        print(
            f"cache cross-encoder {'built' if built else 'already built'}: {path}\n"
            f"  on the validation set ({manifest['validated_on']}) after {chain}: "
            f"{manifest['cuts'][chain]}"
        )
        return 0
    if args.action == "calibrate":
        from switchyard.config import CacheConfig, EmbeddingsConfig
        from switchyard.decide.calibrate import minilm_embed, parse_thresholds, run_calibration
        from switchyard.decide.candidate import CandidateCheck, from_config

        embed = minilm_embed(runtime=args.runtime)
        thresholds = parse_thresholds(args.thresholds)
        cfg = CacheConfig()
        # As the gateway serves: the rules, the learned model and the cross-encoder.
        check = from_config(cfg, EmbeddingsConfig())
        if check.unavailable is not None:
            print(f"switchyard: {check.unavailable}", file=sys.stderr)
            return 1
        print(f"candidate checks: {check.describe()}")
        no_rules = CandidateCheck(False, check.model, check.encoder)
        print(
            run_calibration(
                args.pairs,
                thresholds,
                args.max_false_hit_rate,
                embed,
                (lambda a, b: (True, "")) if not check.rules else None,
                cfg.threshold,
                no_rules if (no_rules.model or no_rules.encoder) else None,
            )
        )
        return 0
    import urllib.error
    import urllib.request

    key = os.environ.get(args.admin_key_env)
    if not key:
        print(f"switchyard: set {args.admin_key_env} to the gateway's admin key", file=sys.stderr)
        return 2
    body = {
        k: getattr(args, k)
        for k in ("tenant", "model", "tag", "partition")
        if getattr(args, k) is not None
    }
    empty = [k for k, v in body.items() if not v.strip()]
    if empty:  # an unset shell variable: dropping the filter would widen the purge
        print(f"switchyard: --{empty[0]} is empty", file=sys.stderr)
        return 2
    if not body:
        print(
            "switchyard: give at least one of --tenant, --model, --tag, --partition",
            file=sys.stderr,
        )
        return 2
    body["dry_run"] = args.dry_run
    req = urllib.request.Request(
        args.url.rstrip("/") + "/admin/cache/invalidate",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            print(json.dumps(json.loads(resp.read()), indent=2))
    except urllib.error.HTTPError as exc:
        print(f"switchyard: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except urllib.error.URLError as exc:
        print(f"switchyard: cannot reach {args.url}: {exc.reason}", file=sys.stderr)
        return 1
    return 0


def add_cache(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cache = sub.add_parser("cache", help="response cache: invalidate, calibrate")
    csub = cache.add_subparsers(dest="action", required=True)
    ci = csub.add_parser("invalidate", help="remove entries from a running gateway's cache")
    ci.add_argument("--url", default="http://127.0.0.1:8000")
    ci.add_argument("--admin-key-env", default="SWITCHYARD_ADMIN_KEY")
    for name in ("tenant", "model", "tag", "partition"):
        ci.add_argument(f"--{name}")
    ci.add_argument("--dry-run", action="store_true", help="report what would go; change nothing")
    ci.set_defaults(func=cmd_cache)
    cc = csub.add_parser("calibrate", help="precision/recall per threshold on labelled pairs")
    cc.add_argument(
        "--pairs",
        nargs="+",
        default=[
            "data/cache_pairs_val.jsonl",
            "data/cache_pairs_test.jsonl",
            "data/cache_pairs_test2.jsonl",
        ],
        help="labelled pairs files (A+B: files read as one set): the first tunes, the "
        "rest are held out and only reported (default: the validation set, which the "
        "cross-encoder was not trained on, and the two test sets)",
    )
    cc.add_argument("--thresholds", default="0.50:0.99:0.01", help="start:stop:step")
    cc.add_argument("--max-false-hit-rate", type=float, default=0.01)
    cc.add_argument(
        "--runtime",
        choices=["onnx-int8", "onnx", "torch"],
        help="embedding runtime (default: the embeddings.runtime default, onnx-int8)",
    )
    cc.set_defaults(func=cmd_cache)
    ct = csub.add_parser(
        "train-verifier", help="fit the learned pair model on the development set (CPU, seconds)"
    )
    ct.add_argument("--pairs", nargs="+", default=["data/cache_pairs.jsonl"])
    ct.add_argument("--threshold", type=float, default=None, help="default: cache.threshold")
    ct.add_argument("--max-false-hit-rate", type=float, default=0.01)
    ct.add_argument("--out", default=None, help="default: the model the gateway ships")
    ct.set_defaults(func=cmd_cache)
    cb = csub.add_parser(
        "build-verifier",
        help="train the cache's cross-encoder on the development sets and export it "
        "(CPU, minutes; cached: `make install` runs it)",
    )
    cb.add_argument("--force", action="store_true", help="train again even if built")
    cb.add_argument(
        "--recut",
        action="store_true",
        help="only choose the cuts again on the validation set (after `train-verifier`)",
    )
    cb.add_argument("--dir", default=None, help="where (default: embeddings.cache_dir's default)")
    cb.add_argument("--threshold", type=float, default=None, help="default: cache.threshold")
    cb.add_argument(
        "--data-dir", default=None, help="the training and validation files (default: data/)"
    )
    cb.set_defaults(func=cmd_cache)
