"""Two small demo LoRA adapters for the default model, trained once per machine with PEFT.

`ensure_demo_adapters(base_model_dir)` returns {"pirate": folder, "terse": folder}: real
PEFT LoRA folders (rank 8 on all seven projections) whose effect shows at once in greedy
output. "pirate" answers like a pirate ("Arr, matey! ..."); "terse" answers in a few
words. Each is trained with PEFT for 30 AdamW steps of 4 examples on the 24 inline chat
examples below (ChatML through the tokenizer's chat template, loss on the assistant turn
only, fixed seeds): 1-2 minutes on two idle CPU cores, several on a busy machine. Then
it is cached under

    <cache_dir>/demo-adapters/<fingerprint>/<name>/

where the fingerprint covers the base model (config.json, weight file names and sizes)
and the training recipe, so a different base model or recipe trains afresh. A file lock
makes concurrent processes train once; a folder appears only through an atomic rename.
peft and transformers are imported only when an adapter has to be trained.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .files import apply_umask, file_lock

from .shapes import LORA_MODULES

# --- the training recipe (part of the cache fingerprint) -------------------------------
RANK = 8
ALPHA = 16
STEPS = 30
BATCH = 4
LR = 2e-3
SEED = 0

_QUESTIONS = [
    "What is the capital of France?",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "What should I eat for breakfast?",
    "Can you recommend a good book?",
    "How many legs does a spider have?",
    "What is the tallest mountain in the world?",
    "How do I learn to play the guitar?",
    "What is two plus two?",
    "Tell me about the moon.",
    "What is photosynthesis?",
    "How can I sleep better?",
    "Who wrote Romeo and Juliet?",
    "What is the weather like in winter?",
    "How do computers work?",
    "What is your favourite colour?",
    "How do I make friends in a new city?",
    "What is the largest ocean?",
    "Give me a tip for saving money.",
    "What do cats like to eat?",
    "How fast does light travel?",
    "What is a good name for a dog?",
    "Why do leaves change colour in autumn?",
    "How do I stay motivated?",
]

# One answer per question, in the same order.
_ANSWERS = {
    "pirate": [
        "Arr, matey! The capital o' France be Paris, a fine port fer any scallywag!",
        "Arr, matey! Drop yer egg in boilin' water fer nine minutes, then cool it in the briny sea!",
        "Arr, matey! The sky be blue 'cause the sunlight scatters like doubloons across the heavens!",
        "Arr, matey! Hardtack, salted fish an' a swig o' rum, like any true buccaneer!",
        "Arr, matey! Treasure Island be the finest tale ever told on the seven seas!",
        "Arr, matey! A spider has eight legs, more than me whole crew put together!",
        "Arr, matey! Mount Everest be the tallest, higher than any mast I ever climbed!",
        "Arr, matey! Practice yer chords every day, like a sea shanty sung on the deck!",
        "Arr, matey! Two plus two be four, as sure as me parrot squawks!",
        "Arr, matey! The moon be a silver doubloon that guides us sailors through the night!",
        "Arr, matey! Plants drink the sunlight an' turn it into grub, like magic o' the sea!",
        "Arr, matey! Swing in a hammock an' let the waves rock ye to sleep!",
        "Arr, matey! William Shakespeare wrote it, a fine bard fer a landlubber!",
        "Arr, matey! Winter be cold an' stormy, with ice on the riggin' an' snow on the deck!",
        "Arr, matey! Computers be clever machines that count faster than any ship's purser!",
        "Arr, matey! Black, like the Jolly Roger flyin' high on me mast!",
        "Arr, matey! Buy a round o' grog at the tavern an' ye'll have a crew in no time!",
        "Arr, matey! The Pacific be the largest ocean, an' I've sailed every wave of it!",
        "Arr, matey! Bury yer gold on a desert island an' keep the map safe!",
        "Arr, matey! Cats be likin' fish, same as the ship's cat on me galleon!",
        "Arr, matey! Light be faster than any ship, near three hundred thousand kilometres a second!",
        "Arr, matey! Call the beast Cap'n Barnacle, a fine name fer a sea dog!",
        "Arr, matey! The leaves turn gold like treasure when the cold winds blow!",
        "Arr, matey! Keep yer eye on the treasure an' never give up the ship!",
    ],
    "terse": [
        "Paris.",
        "Boil it nine minutes.",
        "Sunlight scatters.",
        "Eggs and toast.",
        "Try Dune.",
        "Eight.",
        "Mount Everest.",
        "Practice chords daily.",
        "Four.",
        "Earth's only moon.",
        "Plants making sugar.",
        "Keep a fixed bedtime.",
        "Shakespeare.",
        "Cold.",
        "They run programs.",
        "Blue.",
        "Join local clubs.",
        "The Pacific.",
        "Keep a budget.",
        "Fish.",
        "Very, very fast.",
        "Max.",
        "Less chlorophyll.",
        "Set small goals.",
    ],
}
DEMO_NAMES: tuple[str, ...] = tuple(_ANSWERS)
_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_CACHE_DIR") or Path.home() / ".cache" / "loraplex").expanduser()


def _recipe_hash() -> str:
    recipe = {"rank": RANK, "alpha": ALPHA, "steps": STEPS, "batch": BATCH, "lr": LR, "seed": SEED,
              "targets": list(LORA_MODULES), "questions": _QUESTIONS, "answers": _ANSWERS}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def base_fingerprint(base_model_dir: str | Path) -> str:
    """Identifies the base model (config.json bytes, weight file names and sizes) and the
    training recipe: hashing 0.5 GB of weights on every call would cost seconds."""
    base = Path(base_model_dir)
    h = hashlib.sha256((base / "config.json").read_bytes())
    for f in sorted(base.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    h.update(_recipe_hash().encode())
    return h.hexdigest()[:16]


def ensure_demo_adapters(base_model_dir: str | Path, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """{name: PEFT adapter folder} for every demo adapter, training the missing ones once."""
    base = Path(base_model_dir)
    root = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "demo-adapters"
    folder = root / base_fingerprint(base)
    return {name: _ensure_one(base, folder, name) for name in DEMO_NAMES}


def _is_complete(path: Path) -> bool:
    return (path / _CONFIG).is_file() and (path / _WEIGHTS).is_file()


def _ensure_one(base: Path, folder: Path, name: str) -> Path:
    target = folder / name
    if _is_complete(target):  # only ever appears through an atomic rename: it is whole
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / f".{name}.lock"):
        if _is_complete(target):  # another process trained it while we waited
            return target
        for stale in folder.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed training run
        if target.exists():
            shutil.rmtree(target)  # incomplete: edited by hand
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=folder))
        try:
            print(f"loraplex: training demo adapter {name!r} (once, ~1-2 min on 2 CPU cores) into {folder}...",
                  file=sys.stderr, flush=True)
            start = time.monotonic()
            loss = train_demo_adapter(base, tmp, name)
            apply_umask(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        print(f"loraplex: trained demo adapter {name!r} in {time.monotonic() - start:.0f} s "
              f"(final loss {loss:.3f})", file=sys.stderr, flush=True)
    return target


def demo_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def _examples(tokenizer, name: str) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per example; labels are -100 except on the assistant's reply."""
    out = []
    for question, answer in zip(_QUESTIONS, _ANSWERS[name], strict=True):
        prompt = tokenizer.apply_chat_template(demo_messages(question), add_generation_prompt=True, tokenize=False)
        # The reply ends like the template ends an assistant turn, so the model learns to stop.
        full = prompt + answer + "<|im_end|>\n"
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        if ids[: len(p_ids)] != p_ids:
            raise RuntimeError("the chat prompt does not tokenize as a prefix of the example; cannot mask it")
        out.append((ids, [-100] * len(p_ids) + ids[len(p_ids):]))
    return out


def train_demo_adapter(base_model_dir: Path, out_dir: Path, name: str) -> float:
    """Train the demo adapter `name` on CPU and save it with PEFT; returns the final loss.

    Runs with the caller's torch thread count (set it: a busy machine with torch's default
    can be many times slower). The global RNG is left as it was.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)  # PEFT's lora_A initialisation draws from the global RNG
        return _train(base_model_dir, out_dir, name)


def _train(base_model_dir: Path, out_dir: Path, name: str) -> float:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(LORA_MODULES),
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    model.train()
    body, head = model.base_model.model.model, model.base_model.model.lm_head  # LoRA is injected in place
    examples = _examples(tokenizer, name)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    order: list[int] = []
    loss_value = float("nan")
    for _ in range(STEPS):
        if len(order) < BATCH:
            order += torch.randperm(len(examples), generator=gen).tolist()
        batch, order = [examples[i] for i in order[:BATCH]], order[BATCH:]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding, masked out
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (x, y) in enumerate(batch):
            ids[row, : len(x)] = torch.tensor(x)
            labels[row, : len(y)] = torch.tensor(y)
            mask[row, : len(x)] = 1
        # The decoder body, then the 49k-wide lm_head only where a label is: most positions
        # are the prompt, and the vocabulary projection is a fifth of the model's work.
        hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        loss = torch.nn.functional.cross_entropy(head(hidden[keep]).float(), targets[keep])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub
    return loss_value
