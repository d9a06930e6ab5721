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

Tasks (plain text through the tiny BPE tokenizer, one character = one token; every
sequence is the same 201 tokens, so one training sequence teaches both tasks):

* the haystack is 16 copy items ``@ABCD=ABCD;;`` (12 tokens: 3 whole C4 entries;
  capitals only), the ``copy`` task: the loss is on the copied characters and the
  closing ``;``. Eval ``dsv4_copy``: ``@ABCD=`` -> ``ABCD`` (several decode steps,
  inside the window).
* the needle is one record ``##7;`` (4 tokens, 4-aligned: one C4 entry; its value
  the only digit in the sequence) placed between items ``i - 1`` and ``i``, and the
  query ``?##`` closes the sequence: the loss is on ``7;``, weighted as much as all
  the copy targets together. Eval ``dsv4_kv_far``: ``i <= 5``, the needle wholly
  behind the 128-token sliding window (136-196 tokens back): only the compressed
  entries (C4; C128, whose 128-token blocks behind the window are always complete)
  carry it; ``dsv4_kv_near``: ``i >= 6``, inside the window.

The needle is found by its content (a digit) in one hop, so it is learnable in this
budget; general key matching needs an induction circuit (two hops) that stayed at
chance in the first runs (docs/correctness.md). ``--distractors P`` (not in the shipped
stages) puts a digit other than the needle's into each copy item with probability P, so
only the ``##`` record answers; the runs with it are in docs/correctness.md.

Not trained: retrieval past the indexer's top-k span (index_topk 512 x 4 = 2048
tokens: vLLM 0.32's CPU top-k accepts only 512). Below the span every compressed
entry is selected, the indexer's scores do not matter and get no gradient (the
top-k is discrete); 2048-token sequences are beyond this CPU budget (see
docs/correctness.md).

Fixed seeds and thread counts (a rerun on the same machine kind should write the same
bytes). The shipped checkpoint is two stages (docs/correctness.md: 59 + 15 min here)::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_tiny_dsv4.py --out S1
    .venv/bin/python scripts/train_tiny_dsv4.py --init-from S1 --threads 2 \\
        --far-share 0.8 --lr 1.5e-3 --steps 450 --out configs/tiny-dsv4-trained
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_tiny_dsv4.py --dry-run 120   # steps/s
    .venv/bin/python scripts/train_tiny_dsv4.py --write-tasks 100      # the lm_eval docs
    .venv/bin/python scripts/train_tiny_dsv4.py --eval-only [--limit N] [--results-json F]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_oracle_checkpoint as mk  # noqa: E402  (the one name mapping)

SEED = 40
COPY_LEN = 4
ITEM_LEN = 2 * COPY_LEN + 4  # "@ABCD=ABCD;;": 12 tokens, 3 whole C4 entries
N_ITEMS = 16
NEEDLE_LEN = 4  # "##7;"
QUERY = "?##"
SEQ_LEN = N_ITEMS * ITEM_LEN + NEEDLE_LEN + len(QUERY) + 2  # 201, the answer "7;" included
COPY_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"
WINDOW = 128
FAR_MAX_ITEM = 5  # needle before item <= 5: wholly behind the query's window
# cut from configs/tiny-dsv4 to fit 20 MB in bf16 (12.9 M -> 9.2 M parameters); the
# attention's FlashMLA dims (head_dim, rope dim, heads, window, indexer) are untouched
OVERRIDES: dict[str, Any] = {"n_routed_experts": 4, "num_experts_per_tok": 2, "q_lora_rank": 64}


# ---------------------------------------------------------------------------------------
# tasks (text, so vLLM and lm_eval see exactly what training saw)
# ---------------------------------------------------------------------------------------
def copy_item(rng: random.Random) -> tuple[str, str]:
    """(prompt, answer with its closing ``;``) of one copy item; the item's text is
    ``prompt + answer + ";"`` (the second ``;`` pads it to 12 tokens)."""
    s = "".join(rng.choice(COPY_CHARS) for _ in range(COPY_LEN))
    return f"@{s}=", f"{s};"


def with_distractor(rng: random.Random, answer: str, digit: str) -> tuple[str, str]:
    """A copy item (prompt, answer) from ``answer`` with one character replaced by a
    digit other than the needle's ``digit``."""
    s, k = answer[:-1], rng.randrange(COPY_LEN)
    s = s[:k] + rng.choice([d for d in DIGITS if d != digit]) + s[k + 1:]
    return f"@{s}=", f"{s};"


def needle_text(rng: random.Random, i: int, distract: float = 0.0
                ) -> tuple[str, str, list[tuple[int, int]]]:
    """(prompt ending in the query, answer digit, copy target spans): 16 copy items
    with the needle record placed before item ``i`` (0..16); each item carries a
    distractor digit with probability ``distract``."""
    digit = rng.choice(DIGITS)
    text, spans = "", []
    for k in range(N_ITEMS + 1):
        if k == i:
            text += f"##{digit};"
        if k == N_ITEMS:
            break
        p, a = copy_item(rng)
        if distract and rng.random() < distract:
            p, a = with_distractor(rng, a, digit)
        text += p
        spans.append((len(text), len(text) + len(a)))
        text += a + ";"
    return text + QUERY, digit, spans


def needle_distance(i: int) -> int:
    """Tokens from the query's last token back to the needle's value token."""
    return (N_ITEMS * ITEM_LEN + NEEDLE_LEN + len(QUERY) - 1) - (ITEM_LEN * i + 2)


def kv_doc(rng: random.Random, far: bool, distract: float = 0.0) -> dict[str, Any]:
    """One eval doc: the needle ``far`` behind the query's sliding window (needle
    record wholly outside it) or inside it."""
    i = rng.randrange(0, FAR_MAX_ITEM + 1) if far else rng.randrange(FAR_MAX_ITEM + 1,
                                                                      N_ITEMS + 1)
    prompt, digit, _ = needle_text(rng, i, distract)
    dist = needle_distance(i)
    assert (dist - 1 >= WINDOW) == far, (i, dist)  # the whole record (value - 2 ..) behind
    return {"prompt": prompt, "answer": digit, "record": i, "distance": dist}


def copy_doc(rng: random.Random) -> dict[str, Any]:
    p, a = copy_item(rng)
    return {"prompt": p, "answer": a[:-1]}


def train_example(rng: random.Random, far_share: float | None = None, distract: float = 0.0
                  ) -> tuple[str, list[tuple[int, int]], tuple[int, int]]:
    """(text, copy target spans, needle answer span). Every char is one token. The
    needle's item is uniform, or behind the window with probability ``far_share``."""
    if far_share is None:
        i = rng.randrange(N_ITEMS + 1)
    elif rng.random() < far_share:
        i = rng.randrange(FAR_MAX_ITEM + 1)
    else:
        i = rng.randrange(FAR_MAX_ITEM + 1, N_ITEMS + 1)
    prompt, digit, spans = needle_text(rng, i, distract)
    text = prompt + digit + ";"
    assert len(text) == SEQ_LEN
    return text, spans, (len(prompt), len(text))


# ---------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------
def trained_config(seed: int = SEED) -> dict[str, Any]:
    cfg = mk.oracle_config(seed)
    cfg.pop("vllm_dsv4_oracle_checkpoint", None)
    cfg.update(OVERRIDES)
    cfg["vllm_dsv4_trained"] = {"script": "scripts/train_tiny_dsv4.py", "seed": seed, "stages": []}
    return cfg


def char_ids(tok: Any) -> dict[str, int]:
    """char -> token id, checked: every training char is its own token."""
    table = {}
    for c in set(COPY_CHARS + DIGITS + ";?@=#"):
        ids = tok(c, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (c, ids)
        table[c] = ids[0]
    return table


def encode(tok: Any, table: dict[str, int], text: str) -> list[int]:
    ids = [table[c] for c in text]
    # the tokenizer must agree (no BPE merge among these chars): what serving will see
    assert tok(text, add_special_tokens=False)["input_ids"] == ids, text[:40]
    return ids


def batches(tok: Any, seed: int, batch: int, far_share: float | None, distract: float = 0.0
            ) -> Iterator[tuple[Any, Any, Any]]:
    """(input ids, copy labels, needle labels), -100 where a token is no target."""
    import torch

    table = char_ids(tok)
    rng = random.Random(seed)
    while True:
        xs, copies, needles = [], [], []
        for _ in range(batch):
            text, spans, (a, b) = train_example(rng, far_share, distract)
            ids = [table[c] for c in text]
            copy_lab = [-100] * len(ids)
            for s0, s1 in spans:
                copy_lab[s0:s1] = ids[s0:s1]
            needle_lab = [-100] * len(ids)
            needle_lab[a:b] = ids[a:b]
            xs.append(ids)
            copies.append(copy_lab)
            needles.append(needle_lab)
        yield torch.tensor(xs), torch.tensor(copies), torch.tensor(needles)


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

    sd = mk.hf_to_deepseek(model.state_dict())
    sd = {k: (v.to(torch.bfloat16) if v.dtype.is_floating_point else v) for k, v in sd.items()}
    mk.save_checkpoint(out, sd, cfg)
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


def eval_docs(seed: int, n: int, distract: float = 0.0) -> dict[str, list[dict[str, Any]]]:
    """The lm_eval tasks' docs (configs/lm_eval/tasks/data/): a seed apart from training."""
    rng = random.Random(seed)
    return {"dsv4_kv_far": [kv_doc(rng, True, distract) for _ in range(n)],
            "dsv4_kv_near": [kv_doc(rng, False, distract) for _ in range(n)],
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
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dry-run", type=float, default=0.0, metavar="S",
                    help="train for S seconds, print steps/s, write nothing")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--far-share", type=float, default=None, metavar="P",
                    help="place the needle behind the window in a share P of the sequences "
                    "(default: its item uniform, 6 of 17 behind)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="continue from a checkpoint this script wrote (stage 2; data "
                    "stream seeded with --seed + 1000 so it does not repeat stage 1's)")
    ap.add_argument("--distractors", type=float, default=0.0, metavar="P",
                    help="each copy item carries a digit other than the needle's with "
                    "probability P (the answer then needs the needle's '##' record)")
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

    # a fixed thread count makes the run reproducible (the matmuls' split depends on it)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(mk.TINY))
    if args.write_tasks:
        write_tasks(args.seed + 1, args.write_tasks)
        return 0
    docs = eval_docs(args.seed + 1, args.eval_n, args.distractors)
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
    stage: dict[str, Any] = {"steps": args.steps, "lr": args.lr, "batch": args.batch,
                             "seed": args.seed, "far_share": args.far_share,
                             "threads": args.threads,
                             **({"distractors": args.distractors} if args.distractors else {})}
    if args.init_from:
        cfg = json.loads((args.init_from / "config.json").read_text())
        # a data stream of its own per stage (stage 2: seed + 1000)
        data_seed = args.seed + 1000 * len(cfg["vllm_dsv4_trained"]["stages"])
        cfg["vllm_dsv4_trained"]["stages"].append({"init_from": args.init_from.name, **stage})
        torch.manual_seed(args.seed)
        model = mk.load_transformers(args.init_from)
    else:
        cfg["vllm_dsv4_trained"]["stages"].append(stage)
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
    it = batches(tok, data_seed, args.batch, args.far_share, args.distractors)
    ema = None
    step = 0
    for step in range(args.steps):
        x, y_copy, y_needle = next(it)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x, use_cache=False).logits[:, :-1].flatten(0, 1)
        # the needle's one answer per sequence weighs as much as its 80 copy targets
        l_copy, l_needle = (torch.nn.functional.cross_entropy(
            logits, y[:, 1:].flatten(), ignore_index=-100) for y in (y_copy, y_needle))
        loss = l_copy + l_needle
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        el = time.perf_counter() - t0
        if step % args.log_every == 0:
            print(f"[train] step {step} loss {loss.item():.4f} (copy {l_copy.item():.3f}, "
                  f"needle {l_needle.item():.3f}) ema {ema:.4f} "
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
