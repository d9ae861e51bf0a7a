"""Train the semantic cache's verifier: a cross-encoder that reads two prompts together and says
whether a cached answer to one is a correct answer to the other.

The model is all-MiniLM-L6-v2 (Apache-2.0; the embedder's own weights, checked against the pinned
digests of ``carpool.semantic.embed``) with a one-logit head, fine-tuned as a cross-encoder
(``[CLS] a [SEP] b [SEP]``, the pair in canonical order: ``carpool.semantic.verifier.ordered``)
on:

- the development pairs (``--data``: a folder of ``*.jsonl`` rows ``{a, b, same_answer}``, the
  README of ``shared/data/semantic``), lines of even number only (the odd lines are the held-out
  half, never read here), minus every ``CALIBRATION_EVERY``-th of them, kept to pick the
  threshold;
- conversation contexts built from those pairs (``conversation_pairs``): the earlier turns of a
  chat, reworded, with small talk added, or changed in one detail of the assistant's reply;
- texts beside a retyped copy of themselves (``near_repeats``: case, punctuation, greetings);
- the trap families of ``trap_pairs`` (written here, not taken from any data set).

It writes ``--out``: ``model.onnx`` (int8, dynamic quantisation by ONNX Runtime),
``tokenizer.json`` and ``verifier.json`` (threshold, max length, SHA-256 of both files), what
``carpool.semantic.verifier.CrossEncoder`` loads. Reproducible to the bit only with the same
library versions and seed; the threshold is re-derived on every run.

Needs PyTorch on the CPU and transformers, onnx, onnxruntime, tokenizers, safetensors::

    pip install 'torch==2.13.*' --index-url https://download.pytorch.org/whl/cpu
    pip install transformers onnx onnxruntime tokenizers safetensors
    python scripts/train_verifier.py --data path/to/semantic --out verifier/

~20 minutes on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import BertConfig, BertForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from carpool.semantic.embed import MODEL_SHA256, find_model_dir  # noqa: E402
from carpool.semantic.verifier import MAX_LENGTH, ordered, render_context  # noqa: E402

CALIBRATION_EVERY = 10
#: The share of single-turn pairs also used as a conversation's context (training time is the
#: limit: ~40 minutes for all of them on two cores).
CONVERSATION_SHARE = 0.3
#: The share of texts also paired with a retyped copy of themselves (``near_repeats``).
NEAR_REPEAT_SHARE = 0.12
#: The verifier's threshold: the lowest score at which at most this share of the calibration
#: should-miss pairs pass (the embedding threshold and the rules stop more before it).
TARGET_WRONG = 0.02
SEED = 13


def load_rows(folder: Path) -> tuple[list[tuple[str, str, bool]], list[tuple[str, str, bool]]]:
    """(training pairs, calibration pairs) from the even lines of every file in ``folder``."""
    train: list[tuple[str, str, bool]] = []
    calibration: list[tuple[str, str, bool]] = []
    for path in sorted(folder.glob("*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines()):
            if n % 2:
                continue  # the held-out half
            row = json.loads(line)
            a, b = row["a"], row["b"]
            if not (isinstance(a, str) and isinstance(b, str)):
                continue  # conversations: built below, evaluated on their own
            pair = (a, b, bool(row["same_answer"]))
            (calibration if (n // 2) % CALIBRATION_EVERY == 0 else train).append(pair)
    return train, calibration


REPLIES = [
    "Sure, I can help with that.",
    "Okay, noted.",
    "Happy to help. What would you like to know?",
    "Got it.",
    "Thanks for the details.",
]
SMALL_TALK = [
    ("hi", "Hello! How can I help?"),
    ("hello there", "Hi! What can I do for you?"),
    ("good morning", "Good morning! How can I help today?"),
    ("thanks", "You're welcome!"),
    ("ok cool", "Great."),
]


def conversation_pairs(
    pairs: list[tuple[str, str, bool]],
    rng: random.Random,
) -> list[tuple[str, str, bool]]:
    """Context pairs (the earlier turns, ``render_context``) from single-turn pairs: the first
    user turns are the pair's two sides (reworded or changed: its label), with the same reply,
    sometimes small talk before it on one side (no change of answer); and a reply changed in one
    detail (a should-miss pair's other side as the reply) under the same user turn."""
    out = []
    for a, b, same in pairs:
        if rng.random() >= CONVERSATION_SHARE:
            continue
        reply = rng.choice(REPLIES)
        ta = [{"role": "user", "content": a}, {"role": "assistant", "content": reply}]
        tb = [{"role": "user", "content": b}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.4:
            hi, hello = rng.choice(SMALL_TALK)
            chatter = [{"role": "user", "content": hi}, {"role": "assistant", "content": hello}]
            if rng.random() < 0.5:
                ta = chatter + ta
            else:
                tb = tb + chatter
        out.append((render_context(ta), render_context(tb), same))
        if not same and rng.random() < 0.3:
            question = rng.choice(
                ["Can you help me with this?", "I have a question.", "Tell me about it."]
            )
            out.append(
                (
                    render_context(
                        [{"role": "user", "content": question}, {"role": "assistant", "content": a}]
                    ),
                    render_context(
                        [{"role": "user", "content": question}, {"role": "assistant", "content": b}]
                    ),
                    False,
                )
            )
    return out


_CONTRACTIONS = [
    ("what's", "what is"),
    ("don't", "do not"),
    ("can't", "cannot"),
    ("it's", "it is"),
    ("i'm", "i am"),
    ("doesn't", "does not"),
    ("isn't", "is not"),
    ("i've", "i have"),
    ("won't", "will not"),
    ("how's", "how is"),
    ("where's", "where is"),
]
_OPENERS = ["Hi, ", "Hello! ", "hey ", "Quick question: ", "Please, ", "Hi there. ", "Question: "]
_CLOSERS = [" Thanks!", " please", " Thank you.", " thx", " Thanks in advance.", "??", " :)"]


def near_repeats(
    pairs: list[tuple[str, str, bool]],
    rng: random.Random,
) -> list[tuple[str, str, bool]]:
    """Each text beside itself retyped: case, punctuation, a contraction, a greeting or thanks.
    The development pairs have few such pairs and many near-identical traps (a negation), so
    without them the model learns that any small edit is a trap."""
    out = []
    for a, b, _ in pairs:
        for text in (a, b):
            if rng.random() >= NEAR_REPEAT_SHARE:
                continue
            other = text
            for _ in range(rng.randint(1, 3)):
                move = rng.randrange(5)
                if move == 0:
                    other = other.lower() if rng.random() < 0.7 else other.upper()
                elif move == 1:
                    other = other.rstrip("?.!") + rng.choice(["", "?", ".", "??", "!"])
                elif move == 2:
                    for short, long in _CONTRACTIONS:
                        if short in other.lower() or long in other.lower():
                            low = other.lower()
                            other = (
                                low.replace(short, long)
                                if short in low
                                else low.replace(long, short)
                            )
                            break
                elif move == 3:
                    other = rng.choice(_OPENERS) + other[:1].lower() + other[1:]
                else:
                    other = other + rng.choice(_CLOSERS)
            out.append((text, other, True))
    return out


def trap_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    """Pairs of the trap kinds the development data barely has, each beside rewordings of the
    same template that keep the answer (so the model learns the trap, not the template)."""
    out: list[tuple[str, str, bool]] = []
    things = [
        ("cat", "mouse", "chased"),
        ("dog", "mailman", "bit"),
        ("teacher", "student", "praised"),
        ("company", "startup", "acquired"),
        ("server", "client", "sent a message to"),
        ("Alice", "Bob", "paid"),
        ("the parent", "the child", "called"),
        ("Germany", "France", "exported cars to"),
        ("the buyer", "the seller", "sued"),
    ]
    for x, y, verb in things:
        out.append(
            (
                f"Why would the {x} have {verb} the {y}?",
                f"Why would the {y} have {verb} the {x}?",
                False,
            )
        )
        out.append(
            (
                f"Why would the {x} have {verb} the {y}?",
                f"why would the {x} have {verb} the {y}",
                True,
            )
        )
        out.append(
            (f"Explain why the {x} {verb} the {y}.", f"Explain why the {y} {verb} the {x}.", False)
        )
        out.append(
            (
                f"Explain why the {x} {verb} the {y}.",
                f"Can you explain why the {x} {verb} the {y}?",
                True,
            )
        )
    formats = [
        "JSON",
        "YAML",
        "XML",
        "CSV",
        "TOML",
        "Markdown",
        "HTML",
        "Python",
        "Rust",
        "Go",
        "Celsius",
        "Fahrenheit",
        "miles",
        "kilometers",
        "English",
        "French",
        "Spanish",
    ]
    for _ in range(60):
        s, t = rng.sample(formats, 2)
        out.append((f"How do I convert {s} to {t}?", f"How do I convert {t} to {s}?", False))
        out.append((f"How do I convert {s} to {t}?", f"How can I convert {s} into {t}?", True))
        out.append((f"Translate from {s} to {t}", f"Translate from {t} to {s}", False))
    tenses = [
        ("I eat an apple", "I ate an apple"),
        ("she goes to school", "she went to school"),
        ("we will win", "we won"),
        ("they are playing", "they were playing"),
        ("he writes a letter", "he wrote a letter"),
        ("I have finished", "I will finish"),
    ]
    for present, past in tenses:
        for lang in ["French", "German", "Spanish", "Italian"]:
            out.append(
                (f"Translate '{present}' into {lang}", f"Translate '{past}' into {lang}", False)
            )
            out.append((f"Translate {present} into {lang}", f"Translate {past} into {lang}", False))
            out.append(
                (f"Translate '{present}' into {lang}", f"translate '{present}' to {lang}", True)
            )
    opposites = [
        ("upgrade", "downgrade"),
        ("enable", "disable"),
        ("increase", "decrease"),
        ("open", "close"),
        ("lock", "unlock"),
        ("start", "stop"),
        ("add", "remove"),
        ("accept", "reject"),
        ("buy", "sell"),
        ("import", "export"),
        ("upload", "download"),
        ("subscribe to", "unsubscribe from"),
        ("include", "exclude"),
        ("show", "hide"),
        ("encrypt", "decrypt"),
        ("mute", "unmute"),
        ("follow", "unfollow"),
        ("pause", "resume"),
        ("cancel", "renew"),
        ("delete", "restore"),
        ("approve", "deny"),
        ("connect", "disconnect"),
        ("install", "uninstall"),
        ("raise", "lower"),
    ]
    objects = [
        "it",
        "my plan",
        "the account",
        "my subscription",
        "this file",
        "the setting",
        "notifications",
        "the order",
    ]
    for p, q in opposites:
        thing = rng.choice(objects)
        out.append((f"{p} {thing} please", f"{q} {thing} please", False))
        out.append((f"How do I {p} {thing}?", f"How do I {q} {thing}?", False))
        out.append((f"Can you {p} {thing}?", f"Can you {q} {thing}?", False))
        out.append((f"{p} {thing} please", f"please {p} {thing}", True))
        out.append((f"How do I {p} {thing}?", f"how can I {p} {thing}", True))
    comparisons = [(8, 5), (3, 12), (100, 99), (0.5, 0.25), (-2, 1)]
    for p, q in comparisons:
        out.append((f"Is {p} > {q}?", f"Is {p} < {q}?", False))
        out.append((f"Is {p} greater than {q}?", f"Is {p} less than {q}?", False))
        out.append((f"Is {p} greater than {q}?", f"Is {p} larger than {q}?", True))
        out.append((f"Is {p} >= {q}?", f"Is {p} <= {q}?", False))
    code = [
        ("x == 1", "x = 1"),
        ("a != b", "a == b"),
        ("i += 1", "i -= 1"),
        ("x && y", "x || y"),
        ("a << 2", "a >> 2"),
        ("x is None", "x is not None"),
    ]
    for p, q in code:
        out.append((f"What does `{p}` do in Python?", f"What does `{q}` do in Python?", False))
        out.append((f"What does {p} do in C?", f"What does {q} do in C?", False))
        out.append((f"What does `{p}` do in Python?", f"what does `{p}` do in python", True))
    return out


def checked_base(found: Path, into: Path) -> Path:
    """The base model's files (``found``: the cache's snapshot) copied into ``into`` once their
    SHA-256 matches ``MODEL_SHA256``: what is trained on is the bytes that were checked (a file
    of the cache replaced after the check is never read again); a mismatch exits."""
    for name, expected in MODEL_SHA256.items():
        data = (found / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != expected:
            sys.exit(f"{found / name} is not the pinned base model's file (SHA-256 mismatch)")
        (into / name).write_bytes(data)
    return into


def build_model(model_dir: Path) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        type_vocab_size=2,
        num_labels=1,
        hidden_act="gelu",
        attn_implementation="eager",
    )  # exports as plain ONNX ops
    model = BertForSequenceClassification(config)
    weights = {
        f"bert.{k}": v
        for k, v in load_file(str(model_dir / "model.safetensors")).items()
        if k != "embeddings.position_ids"
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"classifier.weight", "classifier.bias"}, missing
    return model


def encode(
    tokenizer: Tokenizer, pairs: list[tuple[str, str, bool]]
) -> list[tuple[list[int], list[int], float]]:
    encoded = tokenizer.encode_batch([ordered(a, b) for a, b, _ in pairs])
    return [
        (e.ids, e.type_ids, float(label)) for e, (_, _, label) in zip(encoded, pairs, strict=True)
    ]


def batches(rows, size: int, rng: random.Random | None):
    """Batches of similar lengths (little padding), in random order when ``rng`` is given."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    if rng is not None:
        rng.shuffle(chunks)
    for chunk in chunks:
        width = max(len(rows[i][0]) for i in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        types = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            n = len(rows[i][0])
            ids[row, :n] = torch.tensor(rows[i][0])
            types[row, :n] = torch.tensor(rows[i][1])
            mask[row, :n] = 1
        yield chunk, ids, mask, types, torch.tensor([rows[i][2] for i in chunk])


def scores(model, rows) -> np.ndarray:
    model.eval()
    out = np.zeros(len(rows), dtype=np.float32)
    with torch.no_grad():
        for chunk, ids, mask, types, _ in batches(rows, 64, None):
            logits = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits[:, 0]
            out[chunk] = torch.sigmoid(logits).numpy()
    return out


def pick_threshold(probs: np.ndarray, labels: np.ndarray) -> float:
    negatives = np.sort(probs[labels == 0])
    k = int(len(negatives) * (1 - TARGET_WRONG))
    return float(min(0.99, max(0.5, negatives[min(k, len(negatives) - 1)] + 1e-4)))


def quantize(fp32: Path, out: Path) -> None:
    """int8 weights, as ONNX Runtime's dynamic quantisation does, but for the word embeddings
    one scale per row: with one scale for the whole table (ONNX Runtime's Gather quantisation),
    a few outlier rows crush the rest and scores move by up to 0.97 against fp32."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(fp32))
    graph = model.graph
    name = next(i.name for i in graph.initializer if i.name.endswith("word_embeddings.weight"))
    table = next(i for i in graph.initializer if i.name == name)
    weights = numpy_helper.to_array(table)
    scale = (np.abs(weights).max(axis=1, keepdims=True) / 127).astype(np.float32)
    graph.initializer.remove(table)
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.round(weights / scale).astype(np.int8), name + ".int8"),
            numpy_helper.from_array(scale, name + ".scale"),
        ]
    )
    for n, node in enumerate(graph.node):
        if node.op_type == "Gather" and node.input[0] == name:
            ids, output = node.input[1], node.output[0]
            graph.node.remove(node)
            for k, new in enumerate(
                [
                    helper.make_node("Gather", [name + ".int8", ids], [output + ".int8"]),
                    helper.make_node(
                        "Cast", [output + ".int8"], [output + ".cast"], to=TensorProto.FLOAT
                    ),
                    helper.make_node("Gather", [name + ".scale", ids], [output + ".scale"]),
                    helper.make_node("Mul", [output + ".cast", output + ".scale"], [output]),
                ]
            ):
                graph.node.insert(n + k, new)
            break
    staged = out / "model.staged.onnx"
    onnx.save(model, str(staged))
    # (ONNX Runtime's transformer optimiser, tried before quantising: fused attention kept its
    # weights in fp32, 32 MB, and ran slower: 4.8 ms a pair against 3.3 ms.)
    quantize_dynamic(
        str(staged),
        str(out / "model.onnx"),
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        per_channel=True,
    )
    staged.unlink()


def export(model, tokenizer_path: Path, out: Path, threshold: float) -> None:
    import onnx  # noqa: F401  (torch.onnx needs it)

    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    ids = torch.ones((2, 16), dtype=torch.long)
    fp32 = out / "model.fp32.onnx"
    torch.onnx.export(
        model,
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        str(fp32),
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["logits"],
        opset_version=17,
        dynamo=False,
        dynamic_axes={
            n: {0: "batch", 1: "tokens"} for n in ["input_ids", "attention_mask", "token_type_ids"]
        },
    )
    quantize(fp32, out)
    fp32.unlink()
    (out / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    digest = {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in ("model.onnx", "tokenizer.json")
    }
    (out / "verifier.json").write_text(
        json.dumps(
            {
                "base": "sentence-transformers/all-MiniLM-L6-v2",
                "threshold": round(threshold, 4),
                "max_length": MAX_LENGTH,
                "sha256": digest,
            },
            indent=2,
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument(
        "--limit", type=int, default=0, help="train on this many pairs (a smoke run)"
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="keep the trained fp32 weights here; if the file exists, skip training and export it",
    )
    args = parser.parse_args()

    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    model_dir = checked_base(find_model_dir(), Path(tempfile.mkdtemp(prefix="carpool-base-")))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=MAX_LENGTH)

    train, calibration = load_rows(args.data)
    train = train + conversation_pairs(train, rng) + near_repeats(train, rng) + trap_pairs(rng)
    calibration = calibration + conversation_pairs(calibration, random.Random(SEED + 1))
    if args.limit:
        rng.shuffle(train)
        train = train[: args.limit]
    rows, cal_rows = encode(tokenizer, train), encode(tokenizer, calibration)
    print(f"{len(rows)} training pairs, {len(cal_rows)} calibration pairs", flush=True)

    model = build_model(model_dir)
    if args.checkpoint is not None and args.checkpoint.exists():
        model.load_state_dict(load_file(str(args.checkpoint)))
        args.epochs = 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = int(args.epochs * ((len(rows) + args.batch - 1) // args.batch))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / (steps - warmup)))
    )
    loss_fn = torch.nn.BCEWithLogitsLoss()
    step, started = 0, time.time()
    while step < steps:
        model.train()
        for _, ids, mask, types, labels in batches(rows, args.batch, rng):
            logits = model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits[:, 0]
            loss = loss_fn(logits, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            if step % 50 == 0:
                print(
                    f"step {step}/{steps} loss {loss.item():.3f} {time.time() - started:.0f}s",
                    flush=True,
                )
            if step >= steps:
                break

    if args.checkpoint is not None and not args.checkpoint.exists():
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(args.checkpoint))
    export(model, model_dir / "tokenizer.json", args.out, 0.5)
    # The threshold is picked on what ships: the int8 model, through carpool's own runtime.
    from carpool.semantic.verifier import CrossEncoder

    verifier = CrossEncoder(args.out)
    probs = np.array(verifier.score([(a, b) for a, b, _ in calibration]))
    reference = scores(model, cal_rows)
    labels = np.array([r[2] for r in cal_rows])
    threshold = pick_threshold(probs, labels)
    served = float((probs[labels == 1] >= threshold).mean())
    wrong = float((probs[labels == 0] >= threshold).mean())
    flips = float(((probs >= 0.5) != (reference >= 0.5)).mean())
    print(
        f"int8 against fp32: max |difference| {np.abs(probs - reference).max():.3f}, "
        f"mean {np.abs(probs - reference).mean():.4f}, {flips:.2%} of decisions at 0.5 change",
        flush=True,
    )
    print(
        f"calibration: threshold {threshold:.4f}: {served:.1%} of should-hit pairs pass, "
        f"{wrong:.1%} of should-miss pairs",
        flush=True,
    )
    meta = json.loads((args.out / "verifier.json").read_text())
    meta["threshold"] = round(threshold, 4)
    (args.out / "verifier.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
