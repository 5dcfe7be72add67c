"""`polyserve predictor ...`: build the dataset, train, evaluate and benchmark the proxy model.

    polyserve predictor build-dataset --out ds.jsonl
    polyserve predictor train --out services/predictor/artifacts/proxy-minilm
    polyserve predictor train --objective all --out runs/      # one artifact per objective
    polyserve predictor eval [--artifact DIR ...] [--json results.json]
    polyserve predictor bench [--artifact DIR]
    polyserve predictor train-lexical --out services/predictor/artifacts/lexical-gbm [--ood]
    polyserve predictor eval --ood [--json ood.json]      # in- and out-of-distribution folds
    polyserve predictor score rows.jsonl [--json out.json] # the shipped predictor on data of your own

The datasets default to ``../shared/datasets/text`` beside the checkout
(``--data-dir``); training needs the ``hf`` extra (torch, transformers, peft).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from polyserve.shared.paths import datasets_dir

DEFAULT_DATA = datasets_dir() / "text"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _dataset(args: argparse.Namespace):
    from polyserve.predictor.proxy import data, encoder

    if getattr(args, "dataset", None):
        return data.Dataset.load(args.dataset)
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise SystemExit(f"polyserve predictor: no datasets at {data_dir} (give --data-dir)")
    enc_dir = encoder.resolve_encoder_dir(args.encoder_dir)
    tok = encoder.load_tokenizer(str(enc_dir))
    return data.build(data_dir, tok, encoder.encoder_name(args.encoder_dir), seed=args.split_seed)


def cmd_build(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import data

    ds = _dataset(args)
    ds.save(args.out)
    print(data.summary(ds))
    print(f"written to {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import artifact, model, train

    ds = _dataset(args)
    objectives = list(model.OBJECTIVES) if args.objective == "all" else [args.objective]
    out = Path(args.out)
    pooling = args.pooling
    for obj in objectives:
        cfg = train.TrainConfig(objective=obj, pooling=pooling, encoder_dir=args.encoder_dir,
                                max_length=args.max_length, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                                batch_size=args.batch_size, lr_encoder=args.lr_encoder,
                                phase1_epochs=args.phase1_epochs, phase2_epochs=args.phase2_epochs,
                                phase2_precision=args.phase2_precision,
                                max_train_prompts=args.max_train_prompts, seed=args.seed, threads=args.threads,
                                progress=not args.no_progress)
        target = out / obj if len(objectives) > 1 else out
        t = time.monotonic()
        meta = train.train(ds, cfg, target)
        pooling = meta.pooling  # the probe runs once; the other objectives reuse its choice
        v = meta.extra["val"]
        print(f"{obj}: pooling {meta.pooling}, trained in {time.monotonic() - t:.0f}s, "
              f"val accuracy {v['accuracy']:.3f} tau {v['kendall_tau']:.3f}; "
              f"artifact {target} ({artifact.size_bytes(target) / 1024:.0f} KiB)")
        if "pooling_probe" in meta.extra:
            for p, sc in meta.extra["pooling_probe"].items():
                print(f"  pooling probe {p}: val loss {sc['val_loss']:.4f} accuracy {sc['val_accuracy']:.3f} "
                      f"tau {sc['val_kendall_tau']:.3f}")
    return 0


def _corpus(args: argparse.Namespace):
    from polyserve.predictor.proxy import corpus, encoder

    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():
        raise SystemExit(f"polyserve predictor: no datasets at {data_dir} (give --data-dir)")
    enc_dir = encoder.resolve_encoder_dir(args.encoder_dir)
    return corpus.build(data_dir, encoder.load_tokenizer(str(enc_dir)), encoder.encoder_name(args.encoder_dir),
                        cache_dir=args.cache_dir or None, seed=args.split_seed)


def _ood(args: argparse.Namespace, ds) -> dict:
    from polyserve.predictor.proxy import artifact, ood

    minilm = None if args.no_minilm else (args.minilm_artifact or str(artifact.default_dir("minilm")))
    return ood.run(ds, encoder_dir=args.encoder_dir, minilm=minilm, max_train_rows=args.max_train_rows,
                   max_test_prompts=args.max_test_prompts, model_folds=args.model_folds, seed=args.seed,
                   minilm_precision=None if args.precision == "auto" else args.precision,
                   static=args.static, cache_dir=args.cache_dir or None)


def _store_ood(path: str, out: dict) -> None:
    """Write the measured OOD figures and confusion into a lexical artifact's meta.json."""
    from polyserve.predictor.proxy import artifact, ood

    meta = artifact.read_meta(path)
    meta.ood_confusion = ood.confusion_of(out)
    figures = ood.to_json(out)
    meta.extra["ood"] = {"summary": figures["summary"], "settings": figures["settings"],
                         "folds": {f: {m: {k: v for k, v in s.items() if k != "confusion"} for m, s in r.items()}
                                   for f, r in figures["folds"].items()},
                         "confusion_counts": out["summary"]["OOD all (macro)"]["lexical"].confusion.tolist(),
                         "classes": ["short", "medium", "long", "very long", "extreme (>= p99)"]}
    artifact.write_meta(path, meta)


def cmd_eval_ood(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import ood

    ds = _corpus(args)
    out = _ood(args, ds)
    print(f"corpus {len(ds.rows)} rows, data {ds.data_hash[:12]}; lengths in {ds.tokenizer} WordPiece tokens; "
          f"ran in {out['seconds']:.0f}s")
    print(ood.render(out["folds"], out["summary"]))
    out["consensus_tau"] = ood.consensus_tau(ds)
    print("ceiling of a prompt-only predictor per prompt set (tau of the other models' mean rank): "
          + ", ".join(f"{k} {v:.3f}" for k, v in out["consensus_tau"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(ood.to_json(out), consensus_tau=out["consensus_tau"]), indent=1)
                                   + "\n", encoding="utf-8")
    if args.write_meta:
        _store_ood(args.write_meta, out)
        print(f"OOD figures and ood_confusion written to {args.write_meta}/meta.json")
    return 0


def cmd_train_lexical(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import artifact, corpus, lexical

    ds = _corpus(args)
    t = time.monotonic()
    meta = lexical.train(ds, args.out, encoder_dir=args.encoder_dir, dims=args.dims, rounds=args.rounds,
                         seed=args.seed, exclude_sources=corpus.TEST_ONLY, static=args.static,
                         cache_dir=args.cache_dir or None)
    print(f"lexical-gbm: {meta.extra['train_rows']} training rows, {meta.extra['best_iteration']} trees, "
          f"trained in {time.monotonic() - t:.0f}s; artifact {args.out} "
          f"({artifact.size_bytes(args.out) / 1024:.0f} KiB)")
    if args.ood:
        args.no_minilm = True
        _store_ood(args.out, _ood(args, ds))
        print(f"OOD figures and ood_confusion written to {args.out}/meta.json")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import artifact, lexical, score

    path = args.artifact or str(artifact.default_dir())
    try:
        pred = lexical.LexicalPredictor.load(path, args.encoder_dir)
        rows = score.read_rows(args.rows, pred.tok)
    except (ValueError, OSError, artifact.ArtifactError) as exc:
        _say(f"polyserve predictor score: {exc}")
        return 2
    _say(f"scoring {path} on {len(rows)} rows of {args.rows} ...")
    out = score.run(rows, pred)
    print(score.render(out))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(score.to_json(out), artifact=path, rows_file=args.rows), indent=1))
        print(f"wrote {args.json}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import artifact, evaluate, train

    if args.ood:
        return cmd_eval_ood(args)

    ds = _dataset(args)
    train_rows, rows = ds.split("train"), ds.split(args.split)
    _, classes, default = train.fit_classes(train_rows)
    truth = evaluate.truth_of(rows, classes, default)
    preds = []
    paths: list[str] = []
    for path in args.artifact or [str(artifact.default_dir())]:
        p = Path(path)
        # a directory of artifacts (train --objective all): each of them, ours first
        subdirs = sorted((d for d in p.iterdir() if (d / artifact.META).is_file()),
                         key=lambda d: (d.name != "ordinal_mse", d.name)) \
            if p.is_dir() and not (p / artifact.META).is_file() else []
        paths += [str(d) for d in subdirs] or [path]
    for path in paths:
        t = time.monotonic()
        p, meta = evaluate.artifact_predictions(path, rows, args.encoder_dir, int8=args.int8,
                                                precision=args.precision)
        if meta.data_hash != ds.data_hash:
            _say(f"warning: {path} was trained on data {meta.data_hash[:12]}, evaluating on {ds.data_hash[:12]}")
        served = meta.extra["served_precision"]
        _say(f"{path}: {meta.objective} ({meta.pooling} pooling, encoder {served}, head fitted on "
             f"{meta.precision}) on {len(rows)} rows in {time.monotonic() - t:.0f}s")
        if served != "fp32":
            p.method += f"+{served}"
        if p.method in {q.method for q in preds}:
            p.method = f"{p.method}@{Path(path).name}"
        preds.append(p)
    preds += [evaluate.history_baseline(train_rows, rows, classes, default),
              evaluate.majority_baseline(train_rows, rows, classes, default),
              evaluate.random_baseline(rows, classes, default, args.seed)]
    results = evaluate.table(truth, preds)
    print(f"{args.split} split: {len(rows)} rows, {len({r.prompt for r in rows})} prompts; data {ds.data_hash[:12]}; "
          f"lengths in {ds.tokenizer} WordPiece tokens")
    print(evaluate.render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from polyserve.predictor.proxy import bench

    precisions = tuple(x.strip() for x in args.precision.split(",") if x.strip())
    bad = [x for x in precisions if x not in ("auto", "fp32", "bf16", "int8")]
    if bad or not precisions:
        raise SystemExit(f"polyserve predictor bench: --precision {args.precision!r}: give auto, fp32, bf16 or int8, "
                         "or several of them comma-separated")
    if args.device != "cpu":  # the lexical tier needs no torch; say what is wrong before loading anything
        from polyserve.predictor.proxy.infer import resolve_device

        try:
            resolve_device(args.device)
        except ValueError as exc:
            raise SystemExit(f"polyserve predictor bench: --device: {exc}") from None
    res = bench.run(args.artifact, args.encoder_dir, threads=args.threads, iterations=args.iterations,
                    seconds=args.seconds, max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms,
                    bucket_step=args.bucket_step, int8=args.int8,
                    precisions=precisions,
                    concurrency=tuple(int(x) for x in args.concurrency.split(",")),
                    pad_to_max=not args.no_pad_to_max, device=args.device)
    print(bench.render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyserve predictor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def data_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--data-dir", default=str(DEFAULT_DATA), help="the text/ datasets folder")
        sp.add_argument("--dataset", help="a dataset file from build-dataset (instead of --data-dir)")
        sp.add_argument("--encoder-dir", help="a local BERT checkpoint (default: packaged all-MiniLM-L6-v2)")
        sp.add_argument("--split-seed", type=int, default=0)

    def ood_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "polyserve" / "predictor"),
                        help="where the counted corpus is cached ('' = no cache)")
        sp.add_argument("--max-train-rows", type=int, default=0, help="OOD folds: subsample training rows (0 = all)")
        sp.add_argument("--max-test-prompts", type=int, default=400, help="OOD folds: most test prompts per fold")
        sp.add_argument("--model-folds", type=int, default=5, help="groups of answering models held out in turn")
        sp.add_argument("--static", default="raw", choices=["raw", "combined"],
                        help="lexical tier's static token table: the encoder's input embeddings (default), or "
                             "those + distilled rows (computed once with torch, cached in --cache-dir)")

    b = sub.add_parser("build-dataset", help="count lengths, split by prompt, write JSON lines")
    data_flags(b)
    b.add_argument("--out", required=True)
    b.set_defaults(fn=cmd_build)

    t = sub.add_parser("train", help="two-phase fine-tuning; writes an artifact directory")
    data_flags(t)
    t.add_argument("--out", required=True, help="artifact directory (with --objective all: one per objective)")
    t.add_argument("--objective", default="ordinal_mse",
                   choices=["ordinal_mse", "ordinal_l1", "ce", "reg_log_mse", "reg_log_l1", "all"])
    t.add_argument("--pooling", default="auto", choices=["auto", "cls", "mean"])
    t.add_argument("--max-length", type=int, default=128)
    t.add_argument("--lora-rank", type=int, default=8)
    t.add_argument("--lora-targets", default="all", choices=["all", "qv"],
                   help="LoRA on the attention query/value projections, or on every linear layer")
    t.add_argument("--lr-encoder", type=float, default=5e-4, help="learning rate of the LoRA weights")
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--phase1-epochs", type=float, default=2.0)
    t.add_argument("--phase2-epochs", type=int, default=30)
    t.add_argument("--phase2-precision", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="fit the phase-2 head on the features of the encoder in this precision "
                        "(quantisation-aware; the artifact is then served in it by default)")
    t.add_argument("--max-train-prompts", type=int, default=0, help="train on a random subset (0 = all)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="µ-Serve Table 2 on the test split")
    data_flags(e)
    e.add_argument("--artifact", action="append",
                   help="artifact directory, or a directory of them (repeatable; default: the shipped one)")
    e.add_argument("--split", default="test", choices=["train", "val", "test"])
    e.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "int8"],
                   help="encoder precision (auto: the artifact's, as served)")
    e.add_argument("--int8", action="store_true", help="same as --precision int8")
    e.add_argument("--seed", type=int, default=0, help="seed of the random baseline")
    e.add_argument("--json", help="also write the figures to this file")
    ood_flags(e)
    e.add_argument("--ood", action="store_true",
                   help="in-distribution, leave-one-source-out and leave-models-out folds on the wide corpus, "
                        "methods history / lexical (retrained per fold) / minilm (the shipped artifact)")
    e.add_argument("--no-minilm", action="store_true", help="--ood without the MiniLM tier (no torch needed)")
    e.add_argument("--minilm-artifact", help="the MiniLM artifact of --ood (default: the shipped one)")
    e.add_argument("--write-meta", help="--ood: store the figures and ood_confusion in this lexical artifact")
    e.set_defaults(fn=cmd_eval)

    sc = sub.add_parser("score", help="the shipped (lexical) predictor as served, on JSON lines of your own data")
    sc.add_argument("rows", help="JSON lines: prompt, model, output_tokens or response, optional source")
    sc.add_argument("--artifact", help="a lexical-gbm artifact directory (default: the shipped one)")
    sc.add_argument("--encoder-dir", help="the tokenizer's checkpoint (default: packaged all-MiniLM-L6-v2)")
    sc.add_argument("--json", help="also write the figures to this file")
    sc.set_defaults(fn=cmd_score)

    tl = sub.add_parser("train-lexical", help="the fast tier: prompt features + gradient-boosted trees")
    data_flags(tl)
    ood_flags(tl)
    tl.add_argument("--out", required=True)
    tl.add_argument("--dims", type=int, default=24, help="principal components of the static embeddings")
    tl.add_argument("--rounds", type=int, default=600, help="most boosting rounds (early stopping on val)")
    tl.add_argument("--seed", type=int, default=0)
    tl.add_argument("--precision", default="auto", help=argparse.SUPPRESS)
    tl.add_argument("--ood", action="store_true", help="also run the OOD folds and store them in meta.json")
    tl.set_defaults(fn=cmd_train_lexical)

    bn = sub.add_parser("bench", help="latency at batch 1 and throughput of the proxy model on this machine")
    bn.add_argument("--artifact", default=None,
                    help="an artifact directory, 'shipped' (the lexical default) or 'minilm' (the packaged MiniLM tier)")
    bn.add_argument("--encoder-dir")
    bn.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as the service; 0 = all cores)")
    bn.add_argument("--iterations", type=int, default=50, help="batch-1 predictions per prompt length")
    bn.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    bn.add_argument("--max-batch", type=int, default=16)
    bn.add_argument("--batch-wait-ms", type=float, default=2.0)
    bn.add_argument("--bucket-step", type=int, default=64)
    bn.add_argument("--precision", default="auto",
                    help="encoder precision: auto, fp32, bf16, int8, or several comma-separated, measured side "
                         "by side (e.g. fp32,bf16)")
    bn.add_argument("--concurrency", default="1,16,64", help="concurrent clients of the throughput runs")
    bn.add_argument("--no-pad-to-max", action="store_true", help="skip the pad-to-max_length comparison")
    bn.add_argument("--int8", action="store_true", help="same as --precision int8")
    bn.add_argument("--device", default="cpu",
                    help="the MiniLM tier's torch device: cpu, cuda or cuda:N (the lexical tier runs on the CPU)")
    bn.add_argument("--json", help="also write the figures to this file")
    bn.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `polyserve predictor`."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "peft"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars at every encoder load
    except ImportError:
        pass
    try:
        return int(args.fn(args) or 0)
    except ImportError as exc:
        _say(f"polyserve predictor {args.cmd}: needs the 'hf' extra (pip install 'polyserve[hf]'): {exc}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
