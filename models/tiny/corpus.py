"""The training corpus: the Python standard library of the running interpreter.

It is on every machine that can run this script, needs no network, and is code, which is what an engine demo
completes. Files are taken in sorted relative-path order, so a given Python version always yields the same
corpus and the same held-out split; the report records the version and the corpus digest.
"""

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

# Test suites (`test/`, `unittest/test/`, `distutils/tests/`, ...) are mostly asserts over fixtures, idlelib and
# lib2to3 are applications rather than library code, and site-packages is whatever happens to be installed.
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages"})


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str  # relative to the stdlib root, '/'-separated
    text: str


@dataclass(frozen=True, slots=True)
class Corpus:
    train: list[SourceFile]
    heldout: list[SourceFile]

    def digest(self) -> str:
        """sha256 over every path and text, train then held-out: equal digests mean equal corpora."""
        h = hashlib.sha256()
        for f in self.train + self.heldout:
            h.update(f.path.encode())
            h.update(b"\0")
            h.update(f.text.encode())
            h.update(b"\0")
        return h.hexdigest()

    def summary(self) -> dict[str, int | str]:
        return {
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_bytes": sum(len(f.text.encode()) for f in self.train),
            "heldout_bytes": sum(len(f.text.encode()) for f in self.heldout),
            "sha256": self.digest(),
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(max_bytes: int | None = None, root: Path | None = None) -> list[SourceFile]:
    """`*.py` under the stdlib in sorted relative-path order, stopping before `max_bytes` would be exceeded.

    Files that are not UTF-8 are skipped (there are none outside the test suites in CPython 3.11/3.12).
    """
    root = stdlib_root() if root is None else root
    paths = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py"))
    files: list[SourceFile] = []
    total = 0
    for rel, path in paths:
        if EXCLUDED_DIRS.intersection(rel.split("/")[:-1]):
            continue
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            break
        try:
            files.append(SourceFile(rel, data.decode("utf-8")))
        except UnicodeDecodeError:
            continue
        total += len(data)
    if not files:
        raise ValueError(f"no stdlib sources under {root} within max_bytes={max_bytes}")
    return files


def split_heldout(files: list[SourceFile], every: int) -> Corpus:
    """Every `every`-th file (the last of each run of `every`) is held out for evaluation."""
    if every < 2:
        raise ValueError(f"heldout_every={every} must be at least 2")
    heldout = [f for i, f in enumerate(files) if i % every == every - 1]
    train = [f for i, f in enumerate(files) if i % every != every - 1]
    if not heldout:
        raise ValueError(f"{len(files)} files are too few to hold out every {every}th; lower heldout_every")
    return Corpus(train=train, heldout=heldout)


def token_stream(tokenizer: Tokenizer, files: list[SourceFile], bos_id: int, eos_id: int) -> torch.Tensor:
    """All files as one id stream, each as `<|bos|> text <|eos|>`. [N] int64"""
    encodings = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.append(bos_id)
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


class WindowSampler:
    """Random windows of `length` tokens from a stream, reproducible from `seed` alone."""

    def __init__(self, stream: torch.Tensor, length: int, seed: int) -> None:
        if stream.numel() <= length:
            raise ValueError(f"stream of {stream.numel()} tokens is too short for windows of {length}")
        self.stream = stream
        self.offsets = torch.arange(length, device=stream.device)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch_size: int) -> torch.Tensor:
        """[batch_size, length] int64, on the stream's device."""
        high = self.stream.numel() - self.offsets.numel() + 1
        starts = torch.randint(0, high, (batch_size, 1), generator=self.generator)
        return self.stream[starts.to(self.stream.device) + self.offsets]


def sequential_windows(stream: torch.Tensor, length: int, stride: int) -> torch.Tensor:
    """Windows of `length` tokens every `stride` tokens, so evaluation covers the stream in order. [W, length]"""
    if stream.numel() < length:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {length}")
    return stream.unfold(0, length, stride)
