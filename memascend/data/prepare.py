"""The run's token blocks made in a short-lived child process, so that the training process never
holds the tokenizer, the documents' text or what reading and tokenizing them leave behind.

Loading SmolLM2's fast tokenizer (49,152 ids; ``transformers`` and the Rust ``tokenizers`` state)
adds about 76 MiB to a process's RSS, and deleting it gives back about 13 MiB (glibc keeps the rest
in fragmented arenas, with the Python modules it imported); reading and tokenizing a corpus leave
more. None of it need stay through training: :func:`start` runs ``python -m memascend.data.prepare``,
which does :func:`prepare` (read the documents, :func:`memascend.data.build_blocks` them: with a
:class:`~memascend.data.token_cache.FolderTokenizer`, so that a token-cache hit never loads the
tokenizer at all) and sends the results back over a pipe: the blocks, the tokenizer's number of ids
and, when the run saves a model, the files ``tokenizer.save_pretrained`` writes, which
:class:`SavedTokenizer` writes again, byte for byte, beside the saved model. The blocks are the ones
tokenizing in the training process gives, bit for bit (the same code, run in another process).

The child runs in its own process group (a terminal's Ctrl-C reaches the training process, which
kills it; the child prints nothing), dies with the process that started it (``PR_SET_PDEATHSIG``)
and inherits its environment, working folder and memory cgroup; it imports memascend from the
folder the parent imported it from. Its peak RSS comes back with the results
(:attr:`DataProcess.peak_rss_bytes`).

Wire format, child to parent on one pipe: an 8-byte little-endian header length; the header, UTF-8
JSON: ``{"error": {"class": ..., "message": ...}}`` for a :class:`memascend.errors.MemascendError`,
else ``num_ids``, ``files`` (``[[relative path, bytes], ...]``), ``tensors`` (``[[name, dtype,
shape], ...]``), ``aliases`` (``{name: name sent}``: labels that are their blocks' ids, plain text,
are not sent again and share the ids' tensor, as in :func:`memascend.data.build_blocks`),
``num_documents``, ``num_tokens`` and ``peak_rss_bytes``; then each file's bytes; then each sent
tensor's bytes (C order, native byte order). The parent sends the request (a :class:`DataRequest`
as JSON) on the child's standard input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from memascend import errors

_TENSORS = ("train.input_ids", "train.labels", "eval.input_ids", "eval.labels")
"""The tensors sent, in order (each a :class:`memascend.data.TokenBlocks` field, int64 ``[n, seq_len]``)."""

_DTYPES = ("int64",)
"""Tensor dtypes the wire format carries (``torch`` attribute names)."""

_HEADER_LENGTH_BYTES = 8


@dataclasses.dataclass(frozen=True)
class DataRequest:
    """What the child reads and how it makes the blocks (JSON-serialisable).

    Attributes:
        hf_dir: the resolved model folder (:attr:`memascend.models.loading.ModelSource.hf_dir`).
        origin: what the user named as the model (error messages).
        source, max_documents, data_format, columns, max_bytes: ``--data`` and its options
            (:func:`memascend.data.read_documents`; ``max_bytes`` in bytes).
        seq_len: tokens per block.
        eval_blocks: held-out blocks.
        seed: the run's seed (which documents are held out).
        save_tokenizer: also send the files ``tokenizer.save_pretrained`` writes (a run that saves
            a model); this loads the tokenizer even on a token-cache hit.
    """

    hf_dir: str
    origin: str
    source: str
    max_documents: int | None
    data_format: str
    columns: dict[str, str]
    max_bytes: int
    seq_len: int
    eval_blocks: int
    seed: int
    save_tokenizer: bool

    @classmethod
    def for_run(cls, src, cfg) -> DataRequest:
        """The request of a run (``src``: its :class:`~memascend.models.loading.ModelSource`;
        ``cfg``: its :class:`~memascend.config.RunConfig`)."""
        data = cfg.data
        return cls(hf_dir=str(src.hf_dir), origin=str(src.origin), source=data.source,
                   max_documents=data.max_documents, data_format=data.format, columns=dict(data.columns),
                   max_bytes=int(data.max_bytes), seq_len=data.seq_len, eval_blocks=data.eval_blocks,
                   seed=cfg.train.seed, save_tokenizer=bool(cfg.train.save_model))


@dataclasses.dataclass(frozen=True)
class SavedTokenizer:
    """A tokenizer as the training process keeps it: its number of ids and the files its
    ``save_pretrained`` wrote, written again where the model is saved.

    Attributes:
        num_ids: ``len(tokenizer)``: ids including added tokens.
        files: relative path -> bytes of every file ``save_pretrained`` wrote (empty when the run
            saves no model: then :meth:`save_pretrained` raises).
    """

    num_ids: int
    files: dict[str, bytes]

    def __len__(self) -> int:
        return self.num_ids

    def save_pretrained(self, folder: str | os.PathLike) -> tuple[str, ...]:
        """Write the tokenizer's files into ``folder`` (created if needed), as the tokenizer's own
        ``save_pretrained`` did.

        Returns:
            The paths written.

        Raises:
            RuntimeError: no files were kept (the request did not ask for them).
            OSError: a write failed.
        """
        if not self.files:
            raise RuntimeError("the tokenizer's files were not kept (the data process was not asked for them)")
        folder = Path(folder)
        written = []
        for rel, data in self.files.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written.append(str(path))
        return tuple(written)


def saved_files(tokenizer) -> dict[str, bytes]:
    """Relative path -> bytes of every file ``tokenizer.save_pretrained`` writes (into a temporary
    folder, removed after; what it writes does not depend on the folder).

    Raises:
        OSError: the temporary folder could not be written.
    """
    with tempfile.TemporaryDirectory(prefix="memascend-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        root = Path(tmp)
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` made: ``split`` (:class:`memascend.data.DataSplit`) and ``tokenizer``
    (:class:`SavedTokenizer`)."""

    split: Any
    tokenizer: SavedTokenizer


def prepare(request: DataRequest) -> Prepared:
    """Read the documents and make the token blocks, in this process (the child runs it).

    The tokenizer is a :class:`~memascend.data.token_cache.FolderTokenizer`: loaded only when the
    token cache does not hold the corpus's tokens, or when ``request.save_tokenizer`` asks for its files.

    Raises:
        UserError: unreadable data, a corpus too small for a block, a tokenizer that cannot be loaded
            (:func:`memascend.models.loading.load_tokenizer`), chat data without a chat template.
    """
    from memascend.data import build_blocks, read_documents
    from memascend.data.token_cache import FolderTokenizer
    from memascend.models.loading import ModelSource, load_tokenizer

    src = ModelSource(Path(request.hf_dir), request.origin)
    tokenizer = FolderTokenizer(src.hf_dir, lambda: load_tokenizer(src))
    documents = read_documents(request.source, request.max_documents, data_format=request.data_format,
                               columns=request.columns, max_bytes=request.max_bytes)
    split = build_blocks(documents, tokenizer, request.seq_len, request.eval_blocks, request.seed)
    del documents
    files = saved_files(tokenizer.get()) if request.save_tokenizer else {}
    num_ids = tokenizer.num_ids if tokenizer.num_ids is not None else len(tokenizer.get())
    return Prepared(split=split, tokenizer=SavedTokenizer(num_ids=num_ids, files=files))


# ---- parent side ---------------------------------------------------------------------------------


def _package_root() -> str:
    """The folder the running ``memascend`` package is imported from."""
    return str(Path(__file__).resolve().parents[2])


class DataProcess:
    """The child started by :func:`start`; read its results in order (:meth:`tokenizer`, then
    :meth:`split`), and :meth:`close` it (a context manager: leaving it kills a child still running).

    Attributes:
        peak_rss_bytes: the child's peak RSS in bytes (``ru_maxrss``), once :meth:`tokenizer` has
            read the header, else ``None``.
    """

    def __init__(self, proc: subprocess.Popen, pipe):
        self._proc = proc
        self._pipe = pipe
        self._header: dict | None = None
        self.peak_rss_bytes: int | None = None

    def __enter__(self) -> DataProcess:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        """Kill the child if it still runs, reap it and close the pipe."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._pipe.close()

    def _read_into(self, buf: memoryview) -> None:
        got = 0
        while got < len(buf):
            n = self._pipe.readinto(buf[got:])
            if not n:
                raise self._died()
            got += n

    def _read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self._read_into(memoryview(out))
        return bytes(out)

    def _died(self) -> RuntimeError:
        code = self._proc.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return RuntimeError(f"the data process (reading and tokenizing --data) {how} before sending its results")

    def tokenizer(self) -> SavedTokenizer:
        """Wait for the child's results and read the tokenizer's part.

        Raises:
            MemascendError: the error the child met (the same class and message: a
                :class:`~memascend.errors.UserError` for bad data or tokenizer files).
            RuntimeError: the child died without sending its results (its traceback is on stderr).
        """
        length = int.from_bytes(self._read_bytes(_HEADER_LENGTH_BYTES), "little")
        self._header = header = json.loads(self._read_bytes(length))
        if "error" in header:
            self._proc.wait()
            cls = getattr(errors, header["error"]["class"], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.MemascendError)):
                cls = errors.MemascendError
            raise cls(header["error"]["message"])
        self.peak_rss_bytes = int(header["peak_rss_bytes"])
        files = {rel: self._read_bytes(n) for rel, n in header["files"]}
        return SavedTokenizer(num_ids=int(header["num_ids"]), files=files)

    def split(self):
        """Read the blocks (after :meth:`tokenizer`) straight into their tensors and reap the child.

        Returns:
            :class:`memascend.data.DataSplit`: int64 ``[n, seq_len]`` ids and labels, each tensor its
            own contiguous storage.

        Raises:
            RuntimeError: the child died part way, or exited with an error status.
        """
        import torch

        from memascend.data.blocks import DataSplit, TokenBlocks

        assert self._header is not None, "DataProcess.tokenizer() reads the header first"
        tensors = {}
        for name, dtype, shape in self._header["tensors"]:
            if dtype not in _DTYPES:
                raise RuntimeError(f"the data process sent a tensor of dtype {dtype}")
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self._read_into(memoryview(t.view(-1).numpy()).cast("B"))
            tensors[name] = t
        for name, same in self._header["aliases"].items():
            tensors[name] = tensors[same]
        code = self._proc.wait()
        if code != 0:
            raise self._died()
        h = self._header
        return DataSplit(train=TokenBlocks(tensors["train.input_ids"], tensors["train.labels"]),
                         eval=TokenBlocks(tensors["eval.input_ids"], tensors["eval.labels"]),
                         num_documents=int(h["num_documents"]), num_tokens=int(h["num_tokens"]))


def start(request: DataRequest) -> DataProcess:
    """Start the child that does :func:`prepare` for ``request`` (``python -m memascend.data.prepare``:
    this interpreter, this ``memascend``, this environment and working folder; its own process group).

    Raises:
        OSError: the child could not be started.
    """
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memascend.data.prepare", str(write_fd), str(os.getpid())],
            stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env, process_group=0,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    child = DataProcess(proc, os.fdopen(read_fd, "rb", buffering=0))
    try:
        proc.stdin.write(json.dumps(dataclasses.asdict(request)).encode())
        proc.stdin.close()
    except BrokenPipeError:  # the child died at once: reading its results says how
        pass
    except BaseException:
        child.close()
        raise
    return child


# ---- child side ----------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the process that started it dies (``PR_SET_PDEATHSIG``); exit at
    once if it has died already."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _send(out, header: dict, files: dict[str, bytes] | None = None, tensors: list | None = None) -> None:
    head = json.dumps(header).encode()
    out.write(len(head).to_bytes(_HEADER_LENGTH_BYTES, "little") + head)
    for data in (files or {}).values():
        out.write(data)
    for t in tensors or ():
        out.write(memoryview(t.contiguous().view(-1).numpy()).cast("B"))
    out.flush()


def _same_tensor(a, b) -> bool:
    """Whether ``a`` and ``b`` view the very same elements (storage, offset, shape, strides)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def main(argv: list[str] | None = None) -> int:
    """The child: ``python -m memascend.data.prepare WRITE_FD PARENT_PID``, the :class:`DataRequest`
    as JSON on standard input. Returns the exit status (0 also after sending an error)."""
    args = sys.argv[1:] if argv is None else argv
    write_fd, parent_pid = int(args[0]), int(args[1])
    _die_with_parent(parent_pid)
    with os.fdopen(write_fd, "wb") as out:
        try:
            request = DataRequest(**json.loads(sys.stdin.buffer.read()))
            prepared = prepare(request)
        except errors.MemascendError as exc:
            _send(out, {"error": {"class": type(exc).__name__, "message": str(exc)}})
            return 0
        split, tok = prepared.split, prepared.tokenizer
        named = dict(zip(_TENSORS, [split.train.input_ids, split.train.labels, split.eval.input_ids,
                                    split.eval.labels], strict=True))
        aliases = {f"{part}.labels": f"{part}.input_ids" for part in ("train", "eval")
                   if _same_tensor(named[f"{part}.labels"], named[f"{part}.input_ids"])}
        sent = {name: t for name, t in named.items() if name not in aliases}
        header = {
            "num_ids": tok.num_ids,
            "files": [[rel, len(data)] for rel, data in tok.files.items()],
            "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in sent.items()],
            "aliases": aliases,
            "num_documents": split.num_documents,
            "num_tokens": split.num_tokens,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        _send(out, header, tok.files, list(sent.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
