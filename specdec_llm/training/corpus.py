"""The on-policy corpus: a target's own answers to prompts, kept as compressed integer arrays
that only grow.

Layout: ``<root>/<target fingerprint>/<UTC time>-<content hash>.npz``, one ``numpy``
``savez_compressed`` shard per generation batch, written atomically (a hidden temporary
name, then ``os.replace``). A shard holds no Python objects (it loads with
``allow_pickle=False``):

- ``tokens``: prompt + answer token ids of every record, concatenated (uint16 when the
  vocabulary fits, else uint32); ``starts``: int64 offsets, one more than the records;
- ``prompt_len`` (uint32): the chat-encoded prompt's length in each record;
- ``variant`` (uint16): 0 = the greedy answer, v >= 1 = sampled answer number v;
- ``prompt_key`` (U16): the first 16 hex digits of the sha1 of the prompt text;
- ``meta``: UTF-8 JSON (as uint8) with the provenance: target reference, fingerprint,
  generation dtype, device, mode, temperature, seed and how per-record seeds follow from it,
  max_new_tokens, creation time, package version.

The shards are the only state: a run reads the (prompt_key, variant) pairs present and
generates only the others, so an interrupted run resumes without duplicating or
regenerating anything. Teacher signals (top-k log-probs) are not stored here: they are
recomputed from the records by teacher-forced forwards (``teacher_topk``) into a distill
work directory under ``runs/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecDecError

FORMAT = 1
SEED_RULE = "per record: int(sha1(f'{seed}:{prompt_key}:{variant}')[:15], 16), one Gumbel stream per row"


class CorpusError(SpecDecError, ValueError):
    """A corpus, prompt file or work directory that cannot be used as asked."""


def prompt_key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def item_seed(seed: int, key: str, variant: int) -> int:
    """The sampling seed of one record: fixed by the run's seed, the prompt and the variant,
    so a rerun (or a resumed run, batched differently) draws the same answer."""
    return int(hashlib.sha1(f"{seed}:{key}:{variant}".encode()).hexdigest()[:15], 16)


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("specdec-llm")
    except Exception:  # noqa: BLE001 - not installed (a source checkout): the version is unknown, not an error
        return "unknown"


def corpus_dir(root: Path | str, fp: str) -> Path:
    return Path(root) / fp


def read_prompts(paths: Iterable[Path | str]) -> list[str]:
    """The ``prompt`` fields of JSONL files, in order. A missing file, a line that is not a
    JSON object or one without a ``prompt`` string is a CorpusError naming the file and line."""
    out = []
    for path in map(Path, paths):
        if not path.is_file():
            raise CorpusError(f"prompts: {path} is not a file; give a JSONL file with one {{'prompt': ...}} per line")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"prompts: {path} line {n} is not JSON ({e.msg}); one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise CorpusError(
                    f"prompts: {path} line {n} has no 'prompt' field (a string); "
                    'each line must be a JSON object like {"prompt": "..."}'
                )
            out.append(row["prompt"])
    return out


# -- shards -------------------------------------------------------------------------------
@dataclass
class Record:
    tokens: list[int]  # prompt (chat-encoded) + answer
    prompt_len: int
    prompt_key: str
    variant: int  # 0 greedy, v >= 1 sampled answer v
    shard: str
    meta: dict = field(repr=False)

    @property
    def answer(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def write_shard(
    directory: Path, rows: list[tuple[str, int, list[int], list[int]]], vocab_size: int, meta: dict
) -> Path:
    """One shard of (prompt_key, variant, prompt ids, answer ids) rows, atomically; its name
    (UTC time, then 8 hex digits of its content hash) does not collide between machines."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    seqs = [p + a for _, _, p, a in rows]
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(s) for s in seqs])
    arrays = {
        "tokens": np.array([t for s in seqs for t in s], dtype=dtype),
        "starts": starts,
        "prompt_len": np.array([len(p) for _, _, p, _ in rows], dtype=np.uint32),
        "variant": np.array([v for _, v, _, _ in rows], dtype=np.uint16),
        "prompt_key": np.array([k for k, _, _, _ in rows], dtype="U16"),
    }
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(arrays[name].tobytes())
    meta = {"format": FORMAT, **meta, "records": len(rows), "created": datetime.now(UTC).isoformat()}
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    name = f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{h.hexdigest()[:8]}.npz"
    tmp = directory / f".{name}.tmp"
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, directory / name)
    return directory / name


def read_shard(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    out["meta"] = json.loads(out["meta"].tobytes().decode())
    return out


class Corpus:
    """The shards of one target under ``root`` (``<corpus root>/<fingerprint>``)."""

    def __init__(self, root: Path | str):
        self.root = Path(root)

    def shards(self) -> list[Path]:
        """Every complete shard, by name (creation time): hidden temporaries are not shards."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("*.npz") if not p.name.startswith("."))

    def records(self, shards: Iterable[Path] | None = None) -> Iterator[Record]:
        for path in self.shards() if shards is None else shards:
            z = read_shard(path)
            starts = z["starts"]
            for r in range(len(z["prompt_len"])):
                yield Record(
                    tokens=z["tokens"][starts[r] : starts[r + 1]].astype(np.int64).tolist(),
                    prompt_len=int(z["prompt_len"][r]),
                    prompt_key=str(z["prompt_key"][r]),
                    variant=int(z["variant"][r]),
                    shard=path.name,
                    meta=z["meta"],
                )

    def done(self) -> set[tuple[str, int]]:
        out = set()
        for path in self.shards():
            with np.load(path, allow_pickle=False) as z:
                out.update(zip(z["prompt_key"].tolist(), z["variant"].tolist()))
        return out

    def summary(self) -> dict:
        s = {"shards": 0, "records": 0, "prompt_tokens": 0, "answer_tokens": 0, "bytes": 0, "by_mode": {}}
        targets = set()
        for path in self.shards():
            z = read_shard(path)
            plen = z["prompt_len"].astype(np.int64)
            lens = np.diff(z["starts"])
            s["shards"] += 1
            s["records"] += len(plen)
            s["prompt_tokens"] += int(plen.sum())
            s["answer_tokens"] += int((lens - plen).sum())
            s["bytes"] += path.stat().st_size
            targets.add(z["meta"].get("target", "?"))
            for v in z["variant"].tolist():
                mode = "greedy" if v == 0 else "sampled"
                s["by_mode"][mode] = s["by_mode"].get(mode, 0) + 1
        s["targets"] = sorted(targets)
        return s


# -- growing ------------------------------------------------------------------------------
def _encoded_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Each distinct non-blank prompt's chat-encoded ids, by prompt key, and how many prompts
    were left out as longer than ``max_prompt_tokens``."""
    from .distill import chat_ids

    texts: dict[str, str] = {}
    for p in prompts:
        if p.strip():
            texts.setdefault(prompt_key(p), p)
    encoded: dict[str, list[int]] = {}
    skipped_long = 0
    for k, p in texts.items():
        ids = chat_ids(tokenizer, p)
        if len(ids) > max_prompt_tokens:
            skipped_long += 1
        else:
            encoded[k] = ids
    return encoded, skipped_long


def _work_order(encoded: dict[str, list[int]], samples: int, done: set, batch_size: int, seed: int) -> list:
    """The (prompt key, variant) items the corpus lacks, in a fixed order (by ``seed``), then
    sorted by prompt length inside windows of 8 batches: less padding."""
    items = [(k, v) for k in encoded for v in range(samples + 1) if (k, v) not in done]
    random.Random(seed).shuffle(items)
    window = 8 * batch_size
    return [
        x for i in range(0, len(items), window) for x in sorted(items[i : i + window], key=lambda x: len(encoded[x[0]]))
    ]


def _grow_batch(model, tokenizer, batch: list, encoded: dict, seed: int, temperature: float, max_new_tokens: int):
    """One ``generate`` call: the batch's rows (prompt key, variant, prompt ids, answer ids),
    each sampled row from its own seeded stream (``item_seed``), the others greedy."""
    from .distill import generate_answers

    seeds = [None if v == 0 else item_seed(seed, k, v) for k, v in batch]
    ids = [encoded[k] for k, _ in batch]
    answers = generate_answers(model, tokenizer, ids, max_new_tokens, False, temperature, 0, seeds=seeds)
    return [(k, v, p, ans) for (k, v), p, (ans, _, _) in zip(batch, ids, answers)]


def grow(
    target,
    tokenizer,
    prompts: list[str],
    root: Path | str,
    *,
    samples: int = 0,
    batch_size: int = 32,
    max_new_tokens: int = 256,
    dtype: str = "bfloat16",
    temperature: float = 0.8,
    seed: int = 0,
    max_prompt_tokens: int = 1024,
    deadline: float | None = None,
    max_batches: int | None = None,
    target_ref: str = "",
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Generate the target's answers to ``prompts`` that ``<root>/<fingerprint>`` lacks: the
    greedy one (variant 0) and ``samples`` sampled ones (1..samples) each, one shard per
    batch, until done, ``deadline`` (time.time()) or ``max_batches``. Prompts longer than
    ``max_prompt_tokens`` once chat-encoded are skipped (cutting them would cut the chat
    template's assistant turn). The target is cast to ``dtype`` in place (as distill does);
    its fingerprint is taken before. Returns counts; ``progress`` gets them after each shard."""
    from ..pairs import fingerprint, reference

    fp = fingerprint(target)
    corpus = Corpus(corpus_dir(root, fp))
    done = corpus.done()
    encoded, skipped_long = _encoded_prompts(tokenizer, prompts, max_prompt_tokens)
    items = _work_order(encoded, samples, done, batch_size, seed)
    model = target.to(getattr(torch, dtype))
    meta = _grow_meta(target_ref or reference(target), fp, str(model.device), dtype, samples, temperature, seed)
    meta.update(max_prompt_tokens=max_prompt_tokens, max_new_tokens=max_new_tokens)
    stats = {"fingerprint": fp, "dir": str(corpus.root), "present": len(done), "todo": len(items)}
    stats.update(skipped_long=skipped_long, written=0, shards=0, answer_tokens=0)
    for b, i in enumerate(range(0, len(items), batch_size)):
        if (max_batches is not None and b >= max_batches) or (deadline and time.time() > deadline):
            break
        batch = items[i : i + batch_size]
        rows = _grow_batch(model, tokenizer, batch, encoded, seed, temperature, max_new_tokens)
        mode = _mode(batch)
        greedy = {"temperature": None} if mode == "greedy" else {}
        write_shard(corpus.root, rows, target.config.vocab_size, {**meta, "mode": mode, **greedy})
        stats["written"] += len(rows)
        stats["shards"] += 1
        stats["answer_tokens"] += sum(len(r[3]) for r in rows)
        if progress:
            progress(dict(stats))
    return stats


def _grow_meta(target: str, fp: str, device: str, dtype: str, samples: int, temperature: float, seed: int) -> dict:
    """The provenance of the shards ``grow`` writes (each sets its own ``mode``)."""
    return {
        "target": target,
        "target_fingerprint": fp,
        "dtype": dtype,
        "device": device,
        "mode": "greedy" if samples == 0 else "greedy+sampled",
        "temperature": temperature,  # of the sampled records (None in an all-greedy shard)
        "seed": seed,
        "seed_rule": SEED_RULE,
        "source": "corpus.grow",
        "version": package_version(),
    }


def _mode(batch: Iterable[tuple[str, int]]) -> str:
    kinds = {"greedy" if v == 0 else "sampled" for _, v in batch}
    return kinds.pop() if len(kinds) == 1 else "mixed"


# -- importing a distill data phase ------------------------------------------------------
def import_datastore(data_dir: Path | str, root: Path | str, provenance: dict, tokenizer) -> dict:
    """Convert a ``distill`` data directory (``shard-*.safetensors``, ``manifest.json``,
    ``prompts.jsonl``) into corpus shards under ``<root>/<provenance['target_fingerprint']>``,
    one per DataStore shard, skipping records already present.

    DataStore rows carry no prompt text: which (prompt, variant) each row is follows from the
    manifest's config (``distill.work_blocks``: the data phase's fixed batch order), and is
    checked against the row's stored prompt ids (the pool prompt, chat-encoded by
    ``tokenizer`` and cut as the data phase cut it); a mismatch is an error, not a guess."""
    from .distill import work_blocks

    data_dir = Path(data_dir)
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.is_file() or not (data_dir / "prompts.jsonl").is_file():
        raise CorpusError(f"import: {data_dir} has no manifest.json and prompts.jsonl; give a distill --work DIR")
    manifest = json.loads(manifest_path.read_text())
    cfg = manifest.get("config") or {}
    pool = read_prompts([data_dir / "prompts.jsonl"])
    blocks = work_blocks(len(pool), cfg.get("samples", 1), cfg.get("batch_size", 32), cfg.get("seed", 0))
    fp = provenance["target_fingerprint"]
    corpus = Corpus(corpus_dir(root, fp))
    done = corpus.done()
    cut = cfg.get("max_prompt_tokens", 384)
    stats = {"fingerprint": fp, "dir": str(corpus.root), "datastore_shards": manifest.get("shards", 0)}
    stats.update(written=0, skipped=0, shards=0, answer_tokens=0)
    for n in range(manifest.get("shards", 0)):  # the manifest is saved after its shards: all complete
        path = data_dir / f"shard-{n:05d}.safetensors"
        rows = _imported_rows(path, blocks[n], pool, tokenizer, cut, done)
        stats["skipped"] += len(blocks[n]) - len(rows)
        if rows:
            write_shard(
                corpus.root, rows, provenance.get("vocab_size", 65535), _imported_meta(path, rows, cfg, provenance)
            )
            stats["written"] += len(rows)
            stats["shards"] += 1
            stats["answer_tokens"] += sum(len(r[3]) for r in rows)
    return stats


def _imported_rows(path: Path, block: list, pool: list[str], tokenizer, cut: int, done: set) -> list[tuple]:
    """The corpus rows of one DataStore shard that the corpus lacks (``done``, updated): each
    row checked to be the pool prompt its place in the batch order (``block``) says it is."""
    from safetensors.numpy import load_file

    from .distill import chat_ids

    t = load_file(str(path))
    if len(block) != len(t["prompt_len"]):
        raise CorpusError(f"import: {path} has {len(t['prompt_len'])} rows, its batch {len(block)}")
    rows = []
    for r, (i, v) in enumerate(block):
        seq = t["seq"][t["starts"][r] : t["starts"][r + 1]].astype(np.int64).tolist()
        plen = int(t["prompt_len"][r])
        if seq[:plen] != chat_ids(tokenizer, pool[i])[:cut]:
            raise CorpusError(
                f"import: {path} row {r} is not prompt {i} of prompts.jsonl as this tokenizer "
                "encodes it; was the data phase run with another tokenizer or config?"
            )
        key = prompt_key(pool[i])
        if (key, v) not in done:
            done.add((key, v))
            rows.append((key, v, seq[:plen], seq[plen:]))
    return rows


def _imported_meta(path: Path, rows: list[tuple], cfg: dict, provenance: dict) -> dict:
    """An imported shard's provenance: the target's (``provenance``), the data phase's config
    (``cfg``) and when its DataStore shard was written."""
    mode = _mode((k, v) for k, v, _, _ in rows)
    return {
        "format": FORMAT,
        **provenance,
        "mode": mode,
        "generated": datetime.fromtimestamp(os.path.getmtime(path), UTC).isoformat(),
        "temperature": None if mode == "greedy" else cfg.get("temperature"),
        "max_prompt_tokens": cfg.get("max_prompt_tokens", 384),
        "seed": cfg.get("seed", 0),
        "seed_rule": "distill.build_data: torch.manual_seed(seed + items before the batch), one stream per batch",
        "max_new_tokens": cfg.get("max_new_tokens"),
        "dtype": cfg.get("dtype"),
        "source": f"distill data phase, {path.stem}",
        "version": package_version(),
    }


# -- teacher signals ----------------------------------------------------------------------
def batches_of(records: list[Record], batch_size: int, max_len: int | None = None, pad: int = 0):
    """Right-padded batches of records: (records, input_ids [B, W], attention_mask [B, W]),
    each sequence cut to ``max_len``."""
    for i in range(0, len(records), batch_size):
        chunk = records[i : i + batch_size]
        seqs = [r.tokens[:max_len] if max_len else r.tokens for r in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        yield chunk, ids, mask


@torch.inference_mode()
def _topk_rows(target, chunk: list[Record], ids, mask, topk: int, max_len: int | None):
    """Per record: (prompt, answer, top-k ids [n, k], top-k log-probs fp16 [n, k]) from one
    teacher-forced forward; the LM head runs on answer positions only."""
    dev = target.device
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    if decoder is not None:
        hidden = decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev)).last_hidden_state
    else:  # pragma: no cover - every causal LM in transformers has a decoder
        hidden = None
        logits_all = target(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
    head = target.get_output_embeddings()
    out = []
    for b, r in enumerate(chunk):
        seq = r.tokens[:max_len] if max_len else r.tokens
        plen = min(r.prompt_len, len(seq))
        n = len(seq) - plen
        pos = torch.arange(plen - 1, plen - 1 + n, device=dev)
        logits = head(hidden[b, pos]) if hidden is not None else logits_all[b, pos]
        logp, top = torch.topk(torch.log_softmax(logits.float(), -1), topk, dim=-1)
        out.append((seq[:plen], seq[plen:], top.cpu().to(torch.int32), logp.cpu().half()))
    return out


def teacher_topk(
    target,
    corpus: Corpus,
    work: Path | str,
    *,
    topk: int = 8,
    batch_size: int = 8,
    max_len: int | None = None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """The target's top-k next-token log-probs at every answer position of every record, by
    batched teacher-forced forwards (in the target's dtype), written as ``distill.DataStore``
    shards under ``work/data``: one per corpus shard, in corpus order, each corpus shard once
    (the manifest's ``corpus_shards``). ``specdec-llm distill --phase train --work WORK``
    trains on them."""
    from ..pairs import fingerprint
    from .distill import DataStore

    fp = fingerprint(target)
    if corpus.root.name != fp:
        raise CorpusError(
            f"teacher: the corpus {corpus.root} is for target {corpus.root.name}, this target is {fp}; "
            "use the corpus directory named by this target's fingerprint"
        )
    store = DataStore(Path(work) / "data")
    if store.manifest.get("target_fingerprint", fp) != fp or store.manifest.get("topk", topk) != topk:
        raise CorpusError(
            f"teacher: {store.root} holds top-{store.manifest.get('topk')} data of target "
            f"{store.manifest.get('target_fingerprint')}; use a new --work directory"
        )
    converted = store.manifest.setdefault("corpus_shards", [])
    if store.manifest.get("shards", 0) != len(converted):
        raise CorpusError(f"teacher: {store.root} holds shards that are not from a corpus; use a new --work directory")
    store.manifest.update(target_fingerprint=fp, topk=topk, corpus=str(corpus.root), source="corpus.teacher_topk")
    stats = {"shards": 0, "records": 0, "answer_tokens": 0, "present": len(converted)}
    pad = getattr(target.config, "pad_token_id", None) or 0
    for path in corpus.shards():
        if path.name in converted:
            continue
        records = list(corpus.records([path]))
        order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))  # less padding
        rows: dict[int, tuple] = {}
        for j, (chunk, ids, mask) in enumerate(batches_of([records[i] for i in order], batch_size, max_len, pad)):
            for i, row in zip(order[j * batch_size :], _topk_rows(target, chunk, ids, mask, topk, max_len)):
                rows[i] = row
        store.write_shard([rows[i] for i in range(len(records))])
        converted.append(path.name)
        store.save_manifest()
        stats["shards"] += 1
        stats["records"] += len(records)
        stats["answer_tokens"] += sum(len(r[1]) for r in rows.values())
        if progress:
            progress(dict(stats))
    stats["total_tokens"] = store.manifest.get("tokens", 0)
    return stats


# -- widening the prompt pool -------------------------------------------------------------
LANGUAGES = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese", "Russian"]
TRANSLATE = [
    "Translate the following text into {lang}:\n\n{text}",
    "Translate this into {lang}.\n\n{text}",
    "{text}\n\nTranslate the text above into {lang}.",
    "Please give a {lang} translation of this passage:\n\n{text}",
    "Rewrite the following in {lang}, keeping the meaning:\n\n{text}",
    "English to {lang}:\n{text}",
]
SUMMARIZE = [
    "Summarize the following text in a few sentences.\n\n{text}",
    "Write a short summary of this article:\n\n{text}",
    "{text}\n\nSummarize the text above in one paragraph.",
    "Read the passage below and list its main points as bullets.\n\n{text}",
    "Give a three-sentence summary of the following:\n\n{text}",
    "Condense this document into a brief abstract.\n\n{text}",
]
RAG = [
    "Answer the question using only the documents below. Say which document you used.\n\n{docs}\n\nQuestion: {q}",
    "{docs}\n\nBased on the passages above, respond to the following: {q}",
    "You are given some retrieved context.\n\n{docs}\n\nUsing this context, answer the request below.\n{q}",
    "Context:\n{docs}\n\nTask: {q}\nAnswer from the context; cite the passage number.",
]


def _clean_answer(text: str) -> str | None:
    """A target answer usable as a passage: long enough, not degenerate (repetitive)."""
    text = text.strip()
    words, sents = text.split(), _sentences(text)
    if len(words) < 25 or len(set(words)) < 0.45 * len(words) or len(set(sents)) < 0.8 * len(sents):
        return None
    return text


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 4]


def widen(
    tokenizer,
    answers: list[tuple[str, str]],
    seed_prompts: list[str],
    *,
    n_translate: int = 400,
    n_summarize: int = 200,
    n_rag: int = 400,
    seed: int = 0,
) -> list[dict]:
    """Prompts of the kinds the pool lacks: translation, long-input summarization and
    RAG-style questions over numbered passages, templated from target-written text
    (``answers``: (prompt, answer text) pairs from the corpus) and the seed prompts. Nothing
    is read from any benchmark. Returns {"prompt", "kind", "source"} rows."""
    rng = random.Random(seed)  # (one stream, drawn kind after kind: the same rows for the same seed)
    good = [(p, c) for p, a in answers if (c := _clean_answer(a))]
    out = _translations(rng, good, seed_prompts, n_translate)
    out += _summaries(rng, tokenizer, good, n_summarize)
    out += _rag_questions(rng, good, n_rag)
    seen, unique = set(), []
    for row in out:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            unique.append(row)
    return unique


def _translations(rng: random.Random, good: list[tuple[str, str]], seed_prompts: list[str], n: int) -> list[dict]:
    """Translation prompts over short passages: 1-4 sentences of an answer, or a seed prompt."""
    passages = []
    for _, a in good:
        sents = _sentences(a)
        if sents:
            k = rng.randint(1, min(4, len(sents)))
            j = rng.randrange(len(sents) - k + 1)
            passages.append((" ".join(sents[j : j + k]), "target answer"))
    passages += [(s, "seed prompt") for s in seed_prompts if 5 <= len(s.split()) <= 120]
    rng.shuffle(passages)
    out = []
    for text, src in passages[:n]:
        tmpl, lang = rng.choice(TRANSLATE), rng.choice(LANGUAGES)
        out.append({"prompt": tmpl.format(lang=lang, text=text), "kind": "translation", "source": src})
    return out


def _summaries(rng: random.Random, tokenizer, good: list[tuple[str, str]], n: int) -> list[dict]:
    """Summarization prompts: several distinct target answers joined into one 300-900 token document."""
    lens = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in good]
    out = []
    for _ in range(n if good else 0):
        want = rng.randint(300, 900)
        parts, total = [], 0
        for j in rng.sample(range(len(good)), min(64, len(good))):  # distinct answers
            if total >= want:
                break
            if total + lens[j] <= 900:
                parts.append(good[j][1])
                total += lens[j]
        if total >= 300:
            doc = "\n\n".join(parts)
            out.append(
                {"prompt": rng.choice(SUMMARIZE).format(text=doc), "kind": "summarization", "source": "target answers"}
            )
    return out


def _rag_questions(rng: random.Random, good: list[tuple[str, str]], n: int) -> list[dict]:
    """RAG prompts: 3-5 numbered passages (target answers); the question is the prompt one of them answers."""
    usable = [(p, a) for p, a in good if 4 <= len(p.split()) <= 60 and len(a.split()) <= 220]
    out = []
    for _ in range(n if len(usable) >= 5 else 0):
        docs = rng.sample(usable, rng.randint(3, 5))
        q, _ = docs[rng.randrange(len(docs))]
        body = "\n\n".join(f"[{i + 1}] {a}" for i, (_, a) in enumerate(docs))
        prompt = rng.choice(RAG).format(docs=body, q=q)
        out.append({"prompt": prompt, "kind": "rag", "source": "target answers (the question is one's prompt)"})
    return out


def corpus_answers(corpus: Corpus, tokenizer, prompts: dict[str, str]) -> list[tuple[str, str]]:
    """(prompt text, greedy answer text) of the corpus records whose prompt is known
    (``prompts``: prompt_key -> text) and that ended (end-of-sequence reached)."""
    eos = tokenizer.eos_token_id
    out = []
    for r in corpus.records():
        if r.variant == 0 and r.prompt_key in prompts and r.answer and r.answer[-1] == eos:
            out.append((prompts[r.prompt_key], tokenizer.decode(r.answer, skip_special_tokens=True).strip()))
    return out
