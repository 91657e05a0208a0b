"""Building a draft from a target: on-policy data, then divergence training.

Two resumable phases, both on disk under ``--work DIR``:

1. data: the target's own answers (one greedy, ``samples`` sampled) to instruction
   prompts: the seed prompts plus prompts the target writes itself from them. Generated
   in batches (bf16 by default), stored in safetensors shards with the target's top-k
   next-token log-probabilities at every answer position. A manifest records how far it
   got; re-running continues from there.
2. train: a draft made of chosen target layers, sharing the target's embedding, final
   norm and LM head (frozen), trained on those answers with a sparse forward KL to the
   target's top-k distribution (DistillSpec's white-box objective; on greedy answers its
   argmax labels make it optimise greedy acceptance directly). Checkpoints every
   ``checkpoint_every`` steps; ``resume`` continues from the last one.

The output directory is a draft the pair registry loads (``specdec_draft.json``, the
draft's own tensors in ``draft.safetensors``, ``config.json``).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..errors import SpecDecError
from ..pairs import (
    DRAFT_META,
    SHARED_TENSORS,
    VOCAB_SUBSET,
    SubsetHead,
    draft_dir,
    fingerprint,
    load_draft_dir,
    reference,
    shared_draft,
)
from .evaluate import read_prompts
from .loop import Schedule, TrainLoop, subset_rows

EXPAND_TEMPLATE = (
    "Here is an example of a task someone might ask an AI assistant:\n\n{seed}\n\n"
    "Write one new, different task on a related topic. Reply with the task only."
)


class DistillError(SpecDecError, ValueError):
    """A distillation that cannot go on as asked (no data; a data phase resumed in another order)."""


@dataclass
class DataConfig:
    max_new_tokens: int = 256
    batch_size: int = 32
    dtype: str = "bfloat16"
    expand_per_seed: int = 4  # new prompts the target writes from each seed
    samples: int = 1  # sampled answers per prompt, besides the greedy one
    temperature: float = 0.8
    topk: int = 8  # teacher log-probs kept per answer position
    max_prompt_tokens: int = 384
    seed: int = 0


@dataclass
class TrainConfig:
    layers: list[int] = field(default_factory=lambda: [0, 1])
    steps: int = 2000
    batch_size: int = 16
    lr: float = 1e-3
    warmup: int = 100
    max_len: int = 448
    checkpoint_every: int = 100
    ce_weight: float = 0.1  # hard-label term on the answer token actually generated
    vocab_subset: int = 16384  # draft head over this many most frequent tokens (0: the full vocabulary)
    save_dtype: str = "bfloat16"  # of the exported draft (it is cast to the pair's dtype at load)
    holdout: int = 64  # answers kept out of training to measure agreement at each checkpoint
    init_from: str | None = None  # warm start from this draft directory (its layers and vocabulary subset)
    seed: int = 0


# -- data ---------------------------------------------------------------------------------
def chat_ids(tok, text: str) -> list[int]:
    """``text`` as one user turn through the tokenizer's chat template, the assistant's turn opened."""
    s = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(s, add_special_tokens=False)["input_ids"]


class RowSampler:
    """Sampling with one random stream per row, as a logits processor for greedy ``generate``:
    row ``b`` with a seed gets ``logits / temperature + Gumbel noise`` drawn from its own
    generator, so the argmax is an exact sample of softmax(logits / temperature) that depends
    only on that row's seed and position, not on the batch it shares or the global RNG.
    Rows whose seed is None are left alone (greedy)."""

    def __init__(self, seeds: list[int | None], temperature: float):
        self.temperature = temperature
        self.gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for b, g in enumerate(self.gens):
            if g is not None:
                u = torch.rand(scores.shape[-1], generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
                gumbel = (-torch.log(-torch.log(u))).to(scores.device, scores.dtype)
                scores[b] = scores[b] / self.temperature + gumbel
        return scores


@torch.inference_mode()
def generate_answers(
    model,
    tok,
    prompts: list[list[int]],
    max_new: int,
    sample: bool,
    temperature: float,
    topk: int,
    seeds: list[int | None] | None = None,
):
    """Batched generation (left padded). Returns per row (answer ids, topk ids, topk logp).

    ``topk=0`` keeps no logits (they are [batch, steps, vocab]: the memory-heavy part) and
    returns None for both. ``seeds`` (one per row, None = greedy) samples each row from its
    own seeded stream (``RowSampler``) instead of the global RNG; ``sample`` is then unused."""
    from transformers import LogitsProcessorList

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    per_row = seeds is not None
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=max_new,
        do_sample=sample and not per_row,
        temperature=temperature if sample and not per_row else None,
        top_p=None,
        top_k=None,
        output_logits=topk > 0,
        return_dict_in_generate=True,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList([RowSampler(seeds, temperature)]) if per_row else None,
    )
    answers = out.sequences[:, width:].cpu()
    top = logp = None
    if topk > 0:
        logits = torch.stack(out.logits, 1).float()  # [B, T, V]
        logp, top = torch.topk(torch.log_softmax(logits, -1), topk, dim=-1)
        top, logp = top.cpu(), logp.cpu()
    eos = tok.eos_token_id
    rows = []
    for b in range(len(prompts)):
        ans = answers[b].tolist()
        n = ans.index(eos) + 1 if eos in ans else len(ans)
        rows.append((ans[:n], None if top is None else top[b, :n], None if logp is None else logp[b, :n].half()))
    return rows


def work_blocks(n_prompts: int, samples: int, batch_size: int, seed: int) -> list[list[tuple[int, int]]]:
    """The data phase's batches, in order: (prompt index, variant) items, variant 0 greedy and
    1..samples sampled; shuffled once with ``seed``, in blocks of one kind (each block is one
    full-width ``generate`` call). Fixed by its arguments, so a run resumes by position (and
    ``corpus.import_datastore`` knows which item each stored row is)."""
    rng = random.Random(seed)
    blocks = []
    for kind in (
        [(i, 0) for i in range(n_prompts)],
        [(i, v) for i in range(n_prompts) for v in range(1, 1 + samples)],
    ):
        rng.shuffle(kind)
        blocks += [kind[j : j + batch_size] for j in range(0, len(kind), batch_size)]
    rng.shuffle(blocks)
    return blocks


class DataStore:
    """Shards of (prompt, answer, teacher top-k) under ``root``, with a resumable manifest."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.manifest_path = root / "manifest.json"
        self.manifest = json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}

    def save_manifest(self) -> None:
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=1))
        tmp.replace(self.manifest_path)

    def write_shard(self, rows: list[tuple[list[int], list[int], torch.Tensor, torch.Tensor]]) -> None:
        seqs, starts, plens, tids, tlps = [], [0], [], [], []
        for prompt, answer, top, logp in rows:
            seqs += prompt + answer
            starts.append(len(seqs))
            plens.append(len(prompt))
            tids.append(top)
            tlps.append(logp)
        n = self.manifest.get("shards", 0)
        save_file(
            {
                "seq": torch.tensor(seqs, dtype=torch.int32),
                "starts": torch.tensor(starts, dtype=torch.int64),
                "prompt_len": torch.tensor(plens, dtype=torch.int32),
                "topk_ids": torch.cat(tids).to(torch.int32),
                "topk_logp": torch.cat(tlps),
            },
            str(self.root / f"shard-{n:05d}.safetensors"),
        )
        self.manifest["shards"] = n + 1
        self.manifest["tokens"] = self.manifest.get("tokens", 0) + sum(len(r[1]) for r in rows)

    def examples(self):
        """Every (sequence, prompt_len, topk_ids, topk_logp) stored so far."""
        for n in range(self.manifest.get("shards", 0)):
            t = load_file(str(self.root / f"shard-{n:05d}.safetensors"))
            pos = 0
            for r in range(len(t["prompt_len"])):
                seq = t["seq"][t["starts"][r] : t["starts"][r + 1]]
                plen = int(t["prompt_len"][r])
                m = len(seq) - plen
                yield seq.long(), plen, t["topk_ids"][pos : pos + m].long(), t["topk_logp"][pos : pos + m].float()
                pos += m


def build_data(
    target,
    tok,
    seed_prompts: list[str],
    work: Path,
    cfg: DataConfig,
    progress=None,
    deadline=None,
    pool: Path | None = None,
) -> dict:
    """Phase 1 (resumable): expand the prompts (or take a ready ``pool``), then generate answers shard by shard."""
    store = DataStore(work / "data")
    model = target.to(getattr(torch, cfg.dtype))
    prompts_path = work / "data" / "prompts.jsonl"
    if pool is not None and not prompts_path.exists():  # its prompts as the corpus reads them ('turns' too)
        rows = read_prompts(pool)
        prompts_path.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))
    if not prompts_path.exists():
        prompts = list(dict.fromkeys(p.strip() for p in seed_prompts if p.strip()))
        asks = [chat_ids(tok, EXPAND_TEMPLATE.format(seed=s)) for s in prompts for _ in range(cfg.expand_per_seed)]
        asks = [a for a in asks if len(a) <= cfg.max_prompt_tokens]
        task = progress.add_task("writing prompts", total=len(asks)) if progress else None
        new = []
        for i in range(0, len(asks), cfg.batch_size):
            torch.manual_seed(cfg.seed + i)
            for answer, _, _ in generate_answers(model, tok, asks[i : i + cfg.batch_size], 96, True, 1.0, 1):
                text = tok.decode(answer, skip_special_tokens=True).strip()
                if 10 <= len(text) and text not in prompts:
                    new.append(text)
            if progress:
                progress.advance(task, min(cfg.batch_size, len(asks) - i))
        pool = list(dict.fromkeys(prompts + new))
        prompts_path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in pool))
    pool = [json.loads(line)["prompt"] for line in prompts_path.read_text().splitlines()]
    blocks = work_blocks(len(pool), cfg.samples, cfg.batch_size, cfg.seed)
    total = sum(len(b) for b in blocks)
    done = store.manifest.get("items_done", 0)
    _check_same_order(store.manifest.get("config") if done else None, cfg, store.root)
    task = progress.add_task("target answers", total=total, completed=done) if progress else None
    encoded: dict[int, list[int]] = {}
    end = 0  # items up to the end of this block
    for block in blocks:
        end += len(block)
        if end <= done:  # written by an earlier run
            continue
        if deadline and time.time() > deadline:
            break
        ids = [encoded.setdefault(i, chat_ids(tok, pool[i])[: cfg.max_prompt_tokens]) for i, _ in block]
        torch.manual_seed(cfg.seed + done)
        answers = generate_answers(model, tok, ids, cfg.max_new_tokens, block[0][1] > 0, cfg.temperature, cfg.topk)
        store.write_shard([(p, ans, top, logp) for p, (ans, top, logp) in zip(ids, answers)])
        done += len(block)
        store.manifest.update(items_done=done, items_total=total, prompts=len(pool), config=asdict(cfg))
        store.save_manifest()
        if progress:
            progress.update(task, completed=done, description=f"target answers ({store.manifest['tokens']:,} tokens)")
            if store.manifest["shards"] % 10 == 0:  # a plain line too, for logs of background runs
                progress.console.print(f"data: {done}/{total} answers, {store.manifest['tokens']:,} tokens")
    return store.manifest


ORDER_FIELDS = ("samples", "batch_size", "seed")  # what decides the order a data phase resumes in


def _check_same_order(started: dict | None, cfg: DataConfig, root: Path) -> None:
    """A data phase resumes by position in its work order: with other ``ORDER_FIELDS`` it would
    answer some prompts twice and skip others (and the corpus import refuses the shards)."""
    changed = [f for f in ORDER_FIELDS if started is not None and f in started and started[f] != getattr(cfg, f)]
    if changed:
        was = ", ".join(f"{f} {started[f]}" for f in changed)
        raise DistillError(
            f"the data phase in {root} was started with {was}; resume it with the same "
            "(--gen-batch is batch_size), or start over with another --work"
        )


# -- training -------------------------------------------------------------------------------
def _batches(examples, batch_size: int, max_len: int, rng: random.Random):
    order = list(range(len(examples)))
    if not order:
        raise DistillError("no distillation examples to train on; run the data phase first")
    while True:
        rng.shuffle(order)
        # (fewer examples than a batch: one smaller batch; it looped forever yielding nothing)
        for i in range(0, max(1, len(order) - batch_size + 1), batch_size):
            yield [examples[j] for j in order[i : i + batch_size]]


def choose_subset(store: DataStore, size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The ``size`` token ids the draft head keeps: the most frequent in the target's answers
    and top-k teacher tokens, then the lowest ids (BPE ids roughly follow corpus frequency),
    plus ``always`` (end-of-sequence tokens). Sorted."""
    counts = torch.zeros(vocab)
    for seq, plen, top, _ in store.examples():
        counts += torch.bincount(seq[plen:], minlength=vocab)[:vocab].float()
        counts += 0.5 * torch.bincount(top.flatten(), minlength=vocab)[:vocab].float()
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    # frequency first; ties (mostly unseen tokens) by id: a small bonus for low ids
    score = counts + 1e-6 * (vocab - torch.arange(vocab)) / vocab
    return torch.topk(score, min(size, vocab)).indices.sort().values


def _loss(draft, batch, max_len: int, ce_weight: float, subset_pos: torch.Tensor | None = None):
    """Sparse forward KL(target top-k || draft) (+ a small hard-label term) on answer positions.

    With a SubsetHead draft (``subset_pos`` maps token id -> head row, -1 outside), the
    softmax is over the subset and teacher tokens outside it are dropped (renormalised)."""
    seqs = [ex[0][:max_len] for ex in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, cols, t_ids, t_logp, labels = [], [], [], [], []
    for b, ((_seq, plen, top, logp), s) in enumerate(zip(batch, seqs)):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
        n = len(s) - plen  # answer tokens kept after truncation
        if n <= 0:
            continue
        pos = torch.arange(plen - 1, plen - 1 + n)  # position predicting answer token j
        rows.append(torch.full((n,), b))
        cols.append(pos)
        t_ids.append(top[:n])
        t_logp.append(logp[:n])
        labels.append(s[plen : plen + n])
    dev = draft.device
    hidden = draft.model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
    h = hidden[torch.cat(rows).to(dev), torch.cat(cols).to(dev)]
    t_ids, t_logp, labels = (torch.cat(x).to(dev) for x in (t_ids, t_logp, labels))
    if subset_pos is None:
        logq = torch.log_softmax(draft.lm_head(h).float(), -1)
    else:  # ids -> head rows; tokens outside the subset: masked teacher entries, ignored labels
        logq = torch.log_softmax(draft.lm_head.subset_logits(h).float(), -1)
        pos = subset_pos.to(dev)
        t_ids, labels = pos[t_ids], pos[labels].masked_fill(pos[labels] < 0, -100)
        t_logp = t_logp.masked_fill(t_ids < 0, float("-inf"))
        keep = t_ids[:, 0] >= 0  # positions whose teacher top-1 the draft can propose
        t_ids, t_logp, logq, labels = t_ids[keep].clamp_min(0), t_logp[keep], logq[keep], labels[keep]
    p = torch.softmax(t_logp, -1)  # teacher top-k, renormalised
    kl = (p * (torch.log(p + 1e-9) - logq.gather(-1, t_ids))).sum(-1).mean()
    ce = F.nll_loss(logq, labels, ignore_index=-100)
    agree = (logq.argmax(-1) == t_ids[:, 0]).float().mean()
    return kl + ce_weight * ce, kl.item(), agree.item(), len(labels)


@torch.no_grad()
def heldout_agreement(draft, examples, max_len: int) -> float:
    """Teacher-forced greedy agreement (draft argmax == target argmax at each answer position):
    the per-token greedy acceptance rate on data the draft was not trained on."""
    was_training = draft.training
    draft.eval()
    hits = total = 0
    for seq, plen, top, _ in examples:
        seq = seq[:max_len]
        n = len(seq) - plen
        if n <= 0:
            continue
        logits = draft(input_ids=seq[None].to(draft.device)).logits[0, plen - 1 : plen - 1 + n]
        hits += int((logits.argmax(-1).cpu() == top[:n, 0]).sum())
        total += n
    draft.train(was_training)
    return hits / total if total else 0.0


def save_draft(draft, out: Path, target, layers: list[int], extra: dict, dtype: str = "float32") -> None:
    out.mkdir(parents=True, exist_ok=True)
    own = {
        k: v.detach().to(getattr(torch, dtype)).contiguous()
        for k, v in draft.state_dict().items()
        if not any(k.startswith(s) for s in SHARED_TENSORS)
    }
    if isinstance(draft.lm_head, SubsetHead):  # its rows are the target's: only the ids are the draft's
        own[VOCAB_SUBSET] = draft.lm_head.ids.to(torch.int32)
        extra = {**extra, "vocab_subset": len(draft.lm_head.ids)}
    save_file({k: v.cpu().contiguous() for k, v in own.items()}, str(out / "draft.safetensors"))
    draft.config.to_json_file(str(out / "config.json"))
    meta = {
        "format": 1,
        "target": reference(target),
        "target_fingerprint": fingerprint(target),
        "init_layers": layers,
        "shared": SHARED_TENSORS,
        **extra,
    }
    (out / DRAFT_META).write_text(json.dumps(meta, indent=2))


def _split_heldout(store: DataStore, cfg: TrainConfig) -> tuple[list, list]:
    """The stored examples: those trained on, and a fixed held-out slice (never trained on)
    for the agreement curve at each checkpoint."""
    examples = list(store.examples())
    if not examples:
        raise DistillError(f"no distillation data under {store.root}; run the data phase first (--phase data)")
    held = random.Random(cfg.seed).sample(range(len(examples)), min(cfg.holdout, len(examples) // 10))
    held_set = set(held)
    return [ex for i, ex in enumerate(examples) if i not in held_set], [examples[i] for i in held]


def _start_draft(target, store: DataStore, cfg: TrainConfig, loop: TrainLoop):
    """The draft to train and its vocabulary subset (None: the full head): the checkpoint's
    shape when resuming (it wins over the command line's; weights are loaded later), an
    existing draft's layers, weights and subset with ``init_from``, else new from ``cfg``."""
    if loop.state is not None:
        cfg.layers = loop.state["config"]["layers"]
        subset = loop.saved_subset()
        return shared_draft(target, cfg.layers, subset), subset
    if cfg.init_from:
        draft, meta = load_draft_dir(draft_dir(cfg.init_from), target, fingerprint(target))
        cfg.layers = meta["init_layers"]
        return draft, draft.lm_head.ids if isinstance(draft.lm_head, SubsetHead) else None
    subset = None
    if cfg.vocab_subset and cfg.vocab_subset < target.config.vocab_size:
        eos = target.generation_config.eos_token_id
        always = [eos] if isinstance(eos, int) else list(eos or [])
        subset = choose_subset(store, cfg.vocab_subset, target.config.vocab_size, always)
    return shared_draft(target, cfg.layers, subset), subset


def _export(draft, loop: TrainLoop, out: Path, target, store: DataStore, cfg: TrainConfig) -> None:
    """The draft directory the pair registry loads, with the run's figures so far."""
    train_meta = {
        "steps": loop.step,
        "tokens_seen": loop.tokens_seen,
        "data_tokens": store.manifest.get("tokens"),
        "config": asdict(cfg),
        "heldout_curve": loop.heldout_curve(),
    }
    save_draft(draft.eval(), out, target, cfg.layers, {"train": train_meta}, cfg.save_dtype)
    draft.train()


def train(target, work: Path, out: Path, cfg: TrainConfig, resume: bool, progress=None, deadline=None) -> dict:
    """Phase 2: train the draft's own layers; checkpoint to ``work/ckpt`` and export to ``out``."""
    target = target.float()
    store = DataStore(work / "data")
    examples, heldout = _split_heldout(store, cfg)
    loop = TrainLoop(work / "ckpt", resume)
    draft, subset = _start_draft(target, store, cfg, loop)
    draft.train()
    subset_pos = subset_rows(subset, target.config.vocab_size)
    params = [p for n, p in draft.named_parameters() if n.startswith("model.layers")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    loop.restore(draft, opt, params, draft.device)
    batches = _batches(examples, cfg.batch_size, cfg.max_len, random.Random(cfg.seed + loop.step))
    task = progress.add_task("training", total=cfg.steps, completed=loop.step) if progress else None

    def loss_step():
        loss, kl, agree, n = _loss(draft, next(batches), cfg.max_len, cfg.ce_weight, subset_pos)
        return loss, n, (kl, agree)

    def record(window: list) -> dict:
        mk, ma = (sum(x[i] for x in window) / len(window) for i in (0, 1))
        if progress:
            progress.update(task, completed=loop.step, description=f"training kl={mk:.3f} agree={ma:.3f}")
            if loop.step % 50 == 0:
                progress.console.print(
                    f"train: step {loop.step}/{cfg.steps} tokens {loop.tokens_seen:,} kl {mk:.3f} agreement {ma:.3f}"
                )
        return {"kl": round(mk, 4), "agreement": round(ma, 4)}

    def checkpoint() -> None:
        if heldout and loop.wants_heldout():
            agree = round(heldout_agreement(draft, heldout, cfg.max_len), 4)
            loop.history[-1]["heldout_agreement"] = agree
            if progress:
                progress.console.print(
                    f"train: step {loop.step} tokens {loop.tokens_seen:,} held-out agreement {agree:.3f}"
                )
        own = {k: v for k, v in draft.state_dict().items() if k.startswith("model.layers")}
        loop.save(own, opt, params, subset, asdict(cfg))
        _export(draft, loop, out, target, store, cfg)

    schedule = Schedule(cfg.steps, cfg.lr, cfg.warmup, cfg.checkpoint_every)
    loop.run(loss_step, opt, params, schedule, record, checkpoint, deadline)
    return {"steps": loop.step, "tokens_seen": loop.tokens_seen, "history": loop.history[-5:]}
