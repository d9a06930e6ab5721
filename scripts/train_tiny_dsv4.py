# SPDX-License-Identifier: Apache-2.0
"""Train a tiny DeepSeek-V4 on CPU (transformers' model, autograd) so accuracy gates
measure something (issue 40 item 3).

The checkpoint's shapes are those of ``configs/tiny-dsv4`` (FlashMLA-legal head_dim
512 = 448 + 64, 8 heads, 1 KV head, indexer 64 x 128, layers SWA / C4 / C128 / C4,
sliding window 128, index_topk 512) with three sizes cut so the bf16 file fits in
the repository (<= 20 MB): 4 routed experts (top 2) instead of 64 (top 6) and
q_lora_rank 64 instead of 128. It is
written under DeepSeek's checkpoint names by ``scripts/make_oracle_checkpoint.py``'s
mapping (imported, not copied), so vLLM's loader and transformers both read it.

Tasks (plain text through the tiny BPE tokenizer; each record is exactly 4 tokens,
so record j fills C4 entry j and a record never straddles two entries):

* ``kv`` (60 %): 48 records ``KQZ;`` (key: two capitals, value: one of 36
  digits/capitals), one of them (uniform position) the marker record ``##Z;``,
  then the query ``?##Z`` and 7 queries ``?KQZ`` of other records; the loss is on
  each query's value token. The first query's last token sits at position 194;
  records 0..15 lie wholly behind the 128-token sliding window, so only the
  compressed (C4 / C128) entries carry them: a wrong top-k entry or a lost
  compressed entry changes the answer. The eval tasks ask the marker query (a
  fixed key: one content match, learnable in this budget; general key matching,
  an induction head, stayed near chance in a first 225-step run, see
  docs/correctness.md).
* ``copy`` (40 %): ``@K7QZ=K7QZ;`` (4 characters) packed into the same length;
  the loss is on the copied characters and the closing ``;`` (several decode
  steps in serving).

Not trained: retrieval past the indexer's top-k span (index_topk 512 x 4 = 2048
tokens: vLLM 0.32's CPU top-k accepts only 512). Below the span every compressed
entry is selected, the indexer's scores do not matter and get no gradient (the
top-k is discrete); 2048-token sequences are beyond this CPU budget (see
docs/correctness.md).

Fixed seed, one thread (bit-for-bit rebuilds on the same machine kind). Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_tiny_dsv4.py --dry-run 120
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_tiny_dsv4.py --steps N \\
        --out configs/tiny-dsv4-trained
    .venv/bin/python scripts/train_tiny_dsv4.py --write-tasks 100      # the lm_eval docs
    .venv/bin/python scripts/train_tiny_dsv4.py --eval-only [--limit N] [--results-json F]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_oracle_checkpoint as mk  # noqa: E402  (the one name mapping)

SEED = 40
N_RECORDS = 48
N_QUERIES = 8
SEQ_LEN = 4 * (N_RECORDS + N_QUERIES)  # 224
KEY_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
VAL_CHARS = "0123456789" + KEY_CHARS
COPY_CHARS = KEY_CHARS + "0123456789"
WINDOW = 128
MARKER = "##"  # the queried record's key in the eval tasks (see the module doc)
COPY_LEN = 4
# cut from configs/tiny-dsv4 to fit 20 MB in bf16 (12.9 M -> 9.2 M parameters); the
# attention's FlashMLA dims (head_dim, rope dim, heads, window, indexer) are untouched
OVERRIDES: dict[str, Any] = {"n_routed_experts": 4, "num_experts_per_tok": 2, "q_lora_rank": 64}


# ---------------------------------------------------------------------------------------
# tasks (text, so vLLM and lm_eval see exactly what training saw)
# ---------------------------------------------------------------------------------------
def kv_records(rng: random.Random, n: int = N_RECORDS) -> list[tuple[str, str]]:
    keys: set[str] = set()
    while len(keys) < n:
        keys.add(rng.choice(KEY_CHARS) + rng.choice(KEY_CHARS))
    return [(k, rng.choice(VAL_CHARS)) for k in sorted(keys, key=lambda _: rng.random())]


def kv_text(records: Sequence[tuple[str, str]]) -> str:
    return "".join(f"{k}{v};" for k, v in records)


def with_marker(rng: random.Random, recs: list[tuple[str, str]], j: int) -> str:
    """Record ``j`` becomes the marker record ``##v;`` (its value kept)."""
    recs[j] = (MARKER, recs[j][1])
    return recs[j][1]


def kv_doc(rng: random.Random, far: bool) -> dict[str, Any]:
    """One eval doc: the records, one of them the marker record, and the query
    ``?##``; ``far`` = the marker record lies wholly outside the query's sliding
    window (record index < 16), else it is one of the last 16."""
    recs = kv_records(rng)
    j = rng.randrange(0, 16) if far else rng.randrange(N_RECORDS - 16, N_RECORDS)
    with_marker(rng, recs, j)
    k, v = recs[j]
    prompt = kv_text(recs) + "?" + k
    # the query's last token sits at 4 * N_RECORDS + 2; record j ends at 4 j + 3
    dist = 4 * N_RECORDS + 2 - (4 * j + 3)
    assert (dist >= WINDOW) == far, (j, dist)
    return {"prompt": prompt, "answer": v, "record": j, "distance": dist}


def copy_item(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(COPY_CHARS) for _ in range(COPY_LEN))
    return f"@{s}=", f"{s};"


def copy_doc(rng: random.Random) -> dict[str, Any]:
    p, a = copy_item(rng)
    return {"prompt": p, "answer": a[:-1]}


def train_example(rng: random.Random) -> tuple[str, list[tuple[int, int]]]:
    """(text, [(char_start, char_end), ...] of the loss targets). Every char is one token."""
    if rng.random() < 0.6:
        recs = kv_records(rng)
        marked = rng.randrange(N_RECORDS)
        with_marker(rng, recs, marked)
        text = kv_text(recs)
        spans = []
        others = [j for j in rng.sample(range(N_RECORDS), N_QUERIES) if j != marked]
        for j in [marked, *others[: N_QUERIES - 1]]:
            k, v = recs[j]
            text += f"?{k}"
            spans.append((len(text), len(text) + 1))
            text += v
        return text, spans
    text, spans = "", []
    while True:
        p, a = copy_item(rng)
        if len(text) + len(p) + len(a) > SEQ_LEN:
            break
        text += p
        spans.append((len(text), len(text) + len(a)))
        text += a
    text += ";" * (SEQ_LEN - len(text))
    return text, spans


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
def trained_config(seed: int = SEED) -> dict[str, Any]:
    cfg = mk.oracle_config(seed)
    cfg.pop("vllm_dsv4_oracle_checkpoint", None)
    cfg.update(OVERRIDES)
    cfg["vllm_dsv4_trained"] = {"script": "scripts/train_tiny_dsv4.py", "seed": seed}
    return cfg


def char_ids(tok: Any) -> dict[str, int]:
    """char -> token id, checked: every training char is its own token."""
    table = {}
    for c in set(KEY_CHARS + VAL_CHARS + COPY_CHARS + ";?@=#"):
        ids = tok(c, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (c, ids)
        table[c] = ids[0]
    return table


def encode(tok: Any, table: dict[str, int], text: str) -> list[int]:
    ids = [table[c] for c in text]
    # the tokenizer must agree (no BPE merge among these chars): what serving will see
    assert tok(text, add_special_tokens=False)["input_ids"] == ids, text[:40]
    return ids


def batches(tok: Any, seed: int, batch: int) -> Iterator[tuple[Any, Any]]:
    import torch

    table = char_ids(tok)
    rng = random.Random(seed)
    while True:
        xs, ys = [], []
        for _ in range(batch):
            text, spans = train_example(rng)
            ids = [table[c] for c in text]
            lab = [-100] * len(ids)
            for a, b in spans:
                for i in range(a, b):
                    lab[i] = ids[i]
            xs.append(ids)
            ys.append(lab)
        yield torch.tensor(xs), torch.tensor(ys)


def build_model(cfg: dict[str, Any], seed: int) -> Any:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    hf_cfg = DeepseekV4Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = DeepseekV4ForCausalLM._from_config(hf_cfg, attn_implementation="eager",
                                               dtype=torch.float32)
    # DeepSeek's tid2eid: the hash layer's token -> experts table, seeded and fixed
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            g = torch.Generator().manual_seed(seed)
            n = cfg["n_routed_experts"]
            buf.copy_(torch.stack([torch.randperm(n, generator=g)[: buf.shape[1]]
                                   for _ in range(buf.shape[0])]))
    return model


def save(model: Any, cfg: dict[str, Any], out: Path) -> int:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = mk.hf_to_deepseek(model.state_dict())
    sd = {k: (v.to(torch.bfloat16) if v.dtype.is_floating_point else v).contiguous()
          for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(mk.TINY / f, out / f)
    return (out / "model.safetensors").stat().st_size


# ---------------------------------------------------------------------------------------
# evaluation in transformers (greedy, what the lm_eval tasks ask)
# ---------------------------------------------------------------------------------------
def greedy(model: Any, tok: Any, table: dict[str, int], prompt: str, n: int) -> str:
    import torch

    inv = {v: k for k, v in table.items()}
    ids = encode(tok, table, prompt)
    out = ""
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            t = int(logits.argmax())
            c = inv.get(t, "\x00")
            if c in ";?":
                break
            out += c
            ids.append(t)
    return out


def eval_docs(seed: int, n: int) -> dict[str, list[dict[str, Any]]]:
    """The lm_eval tasks' docs (configs/lm_eval/tasks/data/): a seed apart from training."""
    rng = random.Random(seed)
    return {"dsv4_kv_far": [kv_doc(rng, True) for _ in range(n)],
            "dsv4_kv_near": [kv_doc(rng, False) for _ in range(n)],
            "dsv4_copy": [copy_doc(rng) for _ in range(n)]}


TASKS_DIR = ROOT / "configs" / "lm_eval" / "tasks"


def write_tasks(seed: int, n: int, tasks_dir: Path = TASKS_DIR) -> None:
    """The lm_eval tasks' JSONL docs (``dsv4_<name>`` reads ``data/trained_<name>.jsonl``)."""
    (tasks_dir / "data").mkdir(parents=True, exist_ok=True)
    for task, ds in eval_docs(seed, n).items():
        name = task.removeprefix("dsv4_")
        with open(tasks_dir / "data" / f"trained_{name}.jsonl", "w") as f:
            for d in ds:
                f.write(json.dumps(d, sort_keys=True) + "\n")


def read_tasks(limit: int | None, tasks_dir: Path = TASKS_DIR) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name in ("kv_far", "kv_near", "copy"):
        path = tasks_dir / "data" / f"trained_{name}.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        out[f"dsv4_{name}"] = rows[:limit] if limit else rows
    return out


def lm_eval_results(res: dict[str, Any]) -> dict[str, Any]:
    """transformers' scores as an lm_eval ``results`` table (what ``vllm-dsv4-run
    compare-eval`` / ``serve-eval --baseline`` read); stderr as lm_eval's (n - 1)."""
    table = {}
    for task, r in res.items():
        if task.startswith("_"):
            continue
        p, n = r["acc"], r["n"]
        table[task] = {"alias": task, "exact_match,none": p,
                       "exact_match_stderr,none": math.sqrt(p * (1 - p) / max(n - 1, 1))}
    return {"results": table, "model": "transformers DeepseekV4ForCausalLM fp32",
            "per_doc": {t: r.get("per_doc") for t, r in res.items() if not t.startswith("_")}}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def evaluate(model: Any, tok: Any, docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    table = char_ids(tok)
    model.eval()
    res = {}
    for task, ds in docs.items():
        n_gen = 2 if task != "dsv4_copy" else 10
        per_doc = [greedy(model, tok, table, d["prompt"], n_gen) for d in ds]
        ok = sum(g == d["answer"] for g, d in zip(per_doc, ds))
        lo, hi = wilson(ok, len(ds))
        res[task] = {"acc": ok / len(ds), "n": len(ds), "wilson95": [lo, hi],
                     "per_doc": per_doc}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "configs" / "tiny-dsv4-trained")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dry-run", type=float, default=0.0, metavar="S",
                    help="train for S seconds, print steps/s, write nothing")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue from a checkpoint this script wrote (stage 2; data "
                    "stream seeded with --seed + 1000 so it does not repeat stage 1's)")
    ap.add_argument("--eval-n", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--write-tasks", type=int, default=0, metavar="N",
                    help="write N docs per lm_eval task into configs/lm_eval/tasks/data and exit")
    ap.add_argument("--limit", type=int, default=None,
                    help="--eval-only: the first N docs of each task's JSONL")
    ap.add_argument("--results-json", type=Path, default=None,
                    help="--eval-only: write transformers' scores as an lm_eval results JSON")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)  # the box is shared; also makes the run reproducible
    tok = AutoTokenizer.from_pretrained(str(mk.TINY))
    if args.write_tasks:
        write_tasks(args.seed + 1, args.write_tasks)
        return 0
    docs = eval_docs(args.seed + 1, args.eval_n)
    if args.eval_only:
        # the lm_eval tasks' own docs, scored as the tasks score them (exact match)
        model = mk.load_transformers(args.out)
        res = evaluate(model, tok, read_tasks(args.limit))
        if args.results_json:
            args.results_json.parent.mkdir(parents=True, exist_ok=True)
            args.results_json.write_text(json.dumps(lm_eval_results(res), indent=1) + "\n")
        print(json.dumps({t: {k: v for k, v in r.items() if k != "per_doc"}
                          for t, r in res.items()}, indent=1))
        return 0
    cfg = trained_config(args.seed)
    data_seed = args.seed
    if args.init_from:
        cfg = json.loads((args.init_from / "config.json").read_text())
        cfg["vllm_dsv4_trained"].setdefault("stages", []).append(
            {"init_from": str(args.init_from.name), "steps": args.steps, "lr": args.lr,
             "batch": args.batch, "seed": args.seed})
        torch.manual_seed(args.seed)
        model = mk.load_transformers(args.init_from)
        data_seed = args.seed + 1000
    else:
        model = build_model(cfg, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] params {n_params / 1e6:.2f} M, seq {SEQ_LEN}, batch {args.batch}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, min(100 if not args.init_from else 20, args.steps // 10))

    def lr_at(step: int) -> float:
        if step < warm:
            return args.lr * (step + 1) / warm
        t = (step - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    t0 = time.perf_counter()
    it = batches(tok, data_seed, args.batch)
    ema = None
    step = 0
    for step in range(args.steps):
        x, y = next(it)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=x, labels=y, use_cache=False)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        el = time.perf_counter() - t0
        if step % args.log_every == 0:
            print(f"[train] step {step} loss {loss.item():.4f} ema {ema:.4f} "
                  f"{(step + 1) / el:.3f} steps/s", flush=True)
        if args.dry_run and el > args.dry_run:
            break
    el = time.perf_counter() - t0
    print(f"[train] {step + 1} steps in {el:.0f} s: {(step + 1) / el:.3f} steps/s", flush=True)
    if args.dry_run:
        return 0
    size = save(model, cfg, args.out)
    print(f"[train] wrote {args.out} ({size / 2**20:.2f} MiB)", flush=True)
    model = mk.load_transformers(args.out)  # what ships: the bf16 file, read back
    res = evaluate(model, tok, docs)
    res["_train"] = {"steps": step + 1, "seconds": round(el), "seed": args.seed,
                     "batch": args.batch, "lr": args.lr, "final_loss_ema": ema}
    (args.out / "train_report.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
