"""Checkpoints named as vLLM's users name them, found on disk: a directory, or a Hugging Face hub id ("org/name")
whose snapshot is in the hub's cache (vLLM's --download-dir, else $HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub or
~/.cache/huggingface/hub), at a revision (--revision, --tokenizer-revision: a branch, a tag or a commit; default
main). tpgraph downloads nothing: a checkpoint or revision that is not on disk is refused, with the command that
fetches it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from tpgraph.errors import ConfigError

_COMMIT = re.compile(r"[0-9a-f]{40}")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # (org/name)


def hub_cache(download_dir: str | None = None) -> Path:
    """Where the hub's snapshots are: --download-dir, else where huggingface_hub keeps them."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    # huggingface_hub's order (its constants.HF_HUB_CACHE), the legacy HUGGINGFACE_HUB_CACHE too, $VARIABLES expanded
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return _expanded(os.environ[name])
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                            / "huggingface")
    return _expanded(home) / "hub"


def _expanded(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))


def checkpoint_dirs(model: str | Path | None, tokenizer: str | Path | None, revision: str | None,
                    tokenizer_revision: str | None, download_dir: str | None,
                    named: Callable[[str], str]) -> tuple[str | None, str | None]:
    """The model's and the tokenizer's directories: as given, or a hub id's cached snapshot at its revision. The
    tokenizer is the model's unless `tokenizer` names another, or `tokenizer_revision` another snapshot of it; a
    tokenizer named by hub id is at `revision` where `tokenizer_revision` is not given, as vLLM's.
    `named(field)` is how the caller's user spells a setting (a CLI flag, a keyword), for the messages."""
    for field, value in (("revision", revision), ("tokenizer_revision", tokenizer_revision),
                         ("download_dir", download_dir)):
        if value is not None and not str(value).strip():  # (not the default read in its place)
            raise ConfigError(f"{named(field)} is empty (an unset variable?): give "
                              f"{'the hub cache directory' if field == 'download_dir' else 'a branch, tag or commit'}"
                              f", or leave it out")
    if model is None and (revision is not None or (tokenizer_revision is not None and tokenizer is None)):
        raise ConfigError(f"{named('revision')} and {named('tokenizer_revision')} choose a snapshot of "
                          f"{named('model')} (or {named('tokenizer')}): the built-in model has none")
    cache_flag = named("download_dir")
    resolved = None if model is None else resolve(str(model), revision, download_dir, named("model"), cache_flag)
    flag = named("tokenizer")
    if tokenizer is None and tokenizer_revision is not None:
        tokenizer, flag = model, f"the tokenizer of {named('model')}"  # (the flag the user gave, not --tokenizer)
    # a tokenizer named by hub id is read at the model's revision unless given its own, as vLLM's tokenizer_revision
    # defaults to revision (a directory is read as it is: transformers ignores a revision for one)
    inherited = tokenizer is not None and tokenizer_revision is None and revision is not None and \
        HUB_ID.fullmatch(str(tokenizer)) is not None and not Path(str(tokenizer)).expanduser().exists()
    if inherited:
        tokenizer_revision = revision
    if tokenizer is not None:
        try:
            tokenizer = resolve(str(tokenizer), tokenizer_revision, download_dir, flag, cache_flag)
        except ConfigError as exc:
            if not inherited:
                raise
            raise ConfigError(f"{exc} ({named('tokenizer_revision')} defaults to {named('revision')}, as vLLM's "
                              f"does: give the tokenizer's own)") from None
    return resolved, tokenizer


def resolve(name: str, revision: str | None, download_dir: str | None, flag: str,
            cache_flag: str = "--download-dir") -> str:
    """The directory `name` (the value of `flag`) stands for: itself where it is one (a revision must then be the
    snapshot's own), else the cached snapshot of the hub id at `revision`. `cache_flag` names download_dir."""
    path = Path(name).expanduser()
    if path.is_dir():
        _refuse_repo_folder(path, name, flag, cache_flag)
        if revision is not None:
            _check_revision_of(path, revision, flag)
        _check_links(path, name, flag)
        return str(path)  # (as found: "~/ckpt" expanded, which the loader reads as it is)
    if path.exists():  # (a file: never a hub id, whatever its slashes)
        _refuse_file(name, path, flag)
    if not HUB_ID.fullmatch(name):
        raise ConfigError(f"{flag} {name!r} is not a directory (nor a hub id such as meta-llama/Llama-3.1-8B)")
    cache = hub_cache(download_dir)
    repo = cache / f"models--{name.replace('/', '--')}"
    wanted = revision or "main"
    snapshot = _snapshot(repo, wanted)
    if snapshot is None:
        fetch = f"hf download {name}" + ("" if revision is None else f" --revision {revision}") + (
            "" if download_dir is None else f" --cache-dir {download_dir}")
        raise ConfigError(f"{flag} {name!r} is not a directory, and the hub cache {cache} holds no snapshot of it at "
                          f"revision {wanted!r}; tpgraph downloads nothing: fetch it with `{fetch}`, or give the "
                          f"checkpoint's directory")
    _check_links(snapshot, name, flag)
    return str(snapshot)


# files of a checkpoint that tpgraph reads (its configs, tokenizer, chat template and weights)
_READ_SUFFIXES = (".json", ".jinja", ".safetensors", ".bin")
_LINKS_SHOWN = 3


def _check_links(path: Path, name: str, flag: str) -> None:
    """A checkpoint's files that are links to nothing: a hub snapshot copied with `cp -r` keeps its links to
    ../../blobs, which name nothing from the copy. Each read would find no file (config.json "missing", a weights
    file an OSError, a tokenizer.json passed over for the byte tokenizer)."""
    try:
        entries = list(path.iterdir())
    except OSError:  # (a directory it may not list: the reads that follow say so)
        return
    broken = sorted(f for f in entries if f.suffix in _READ_SUFFIXES and f.is_symlink() and not f.exists())
    if broken:
        shown = ", ".join(f"{f.name} -> {os.readlink(f)}" for f in broken[:_LINKS_SHOWN])
        more = f" (and {len(broken) - _LINKS_SHOWN} more)" if len(broken) > _LINKS_SHOWN else ""
        raise ConfigError(f"{flag} {name!r} holds links to files that do not exist: {shown}{more}; a hub cache "
                          f"snapshot copied without the files its links name? copy it with `cp -rL` (which copies "
                          f"the files), or give the snapshot in the hub cache")


def shown_name(name: str | Path) -> str:
    """A checkpoint as messages to a client name it: a hub cache's snapshot (what a hub id given on the command line
    is resolved to before the engine is made) as its hub id, not its path on this host; anything else as given."""
    path = Path(name)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return _repo_id(path.parent.parent)
    return str(name)


def _repo_id(repo: Path) -> str:
    """The hub id of a hub cache's folder of a repo (models--org--name)."""
    return "/".join(repo.name.split("--")[1:])  # (the hub allows no "--" in a name)


def _refuse_repo_folder(path: Path, name: str, flag: str, cache_flag: str) -> None:
    """A hub cache's folder of a repo (models--org--name), given for one of its snapshots: named as such, with the hub
    id and the snapshot that stand for it."""
    if not path.name.startswith("models--") or not (path / "snapshots").is_dir():
        return
    repo = _repo_id(path)
    main = _snapshot(path, "main")
    snapshot = str(main) if main is not None else f"{path / 'snapshots'}/<commit>"
    cache = f"{cache_flag} {path.parent}" if cache_flag.startswith("-") else f"{cache_flag}={str(path.parent)!r}"
    raise ConfigError(f"{flag} {name!r} is the hub cache's folder of {repo!r}, not a checkpoint: give the hub id "
                      f"{repo!r} (with {cache}) or a snapshot's directory ({snapshot})")


def _refuse_file(name: str, path: Path, flag: str) -> None:
    """A file where a directory goes: a GGUF file (which vLLM loads) is a format not read here; another (a
    checkpoint's config.json, its tokenizer.json) names the directory it is in."""
    if path.suffix.lower() == ".gguf":
        raise ConfigError(f"{flag} {name!r} is a GGUF file: GGUF checkpoints are not supported (tpgraph reads a "
                          f"Hugging Face checkpoint's directory: config.json, tokenizer.json and safetensors or "
                          f"PyTorch .bin weights); give the directory of the checkpoint it was converted from")
    raise ConfigError(f"{flag} {name!r} is a file, not a directory: give its directory, {str(path.parent)!r}")


def _snapshot(repo: Path, revision: str) -> Path | None:
    """A cached repo's snapshot at a revision: a ref (branch or tag) naming a commit, or the commit itself."""
    commit = revision
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    if not _COMMIT.fullmatch(commit):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _check_revision_of(path: Path, revision: str, flag: str) -> None:
    """A directory given with a revision: it must be a hub snapshot at that revision (the one thing on disk)."""
    resolved = path.resolve()
    repo = resolved.parent.parent
    if resolved.parent.name != "snapshots" or not repo.name.startswith("models--"):
        raise ConfigError(f"{flag} {str(path)!r} is a directory, not a hub snapshot, so it has no revision to check "
                          f"against {revision!r}; tpgraph serves what is on disk and downloads nothing: leave the "
                          f"revision out")
    at = _snapshot(repo, revision)
    if at is None or at.resolve() != resolved:
        raise ConfigError(f"{flag} {str(path)!r} is the snapshot of commit {resolved.name}, not of revision "
                          f"{revision!r}; tpgraph downloads nothing: give that revision's snapshot, or leave the "
                          f"revision out")
