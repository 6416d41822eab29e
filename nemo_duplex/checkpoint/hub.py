"""Where a checkpoint comes from: a local directory, a Hugging Face repo id, or the embedded tiny model.

`checkpoint=<dir or repo id>` (and `revision=` for a repo) goes through `huggingface_hub`, so its cache,
`HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and tokens apply as everywhere else: a file the cache holds is
never downloaded again, and a download shows huggingface_hub's progress bars. The LLM tokenizer and the
LLM's HF config are not in the release checkpoint (spec 3.8, 12.4); they are looked up through the
checkpoint's `pretrained_llm` (a directory relative to the checkpoint, or a repo id) the same way.

Nothing here ever makes weights up: the seeded random checkpoint is made only for `embedded`, the
default of the tiny preset (conf/model/nemotron_duplex_tiny.yaml).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

EMBEDDED = "embedded"   # the tiny preset's default: the seeded random checkpoint under outputs/checkpoints/
# The demo recordings of the release repository are not needed to serve it (spec 6.1).
IGNORE_PATTERNS = ["*.wav", "*.mp3", "*.flac", "*.ogg"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class CheckpointNotFound(FileNotFoundError):
    """No checkpoint where the settings point; the message says what was looked for, where, and what to do."""


@dataclass(frozen=True)
class CheckpointSource:
    """A resolved checkpoint: the local directory, and where it came from."""
    path: Path
    repo_id: str | None = None      # set when it came through the hub
    revision: str | None = None     # what was asked for
    commit: str | None = None       # the snapshot's commit (the hub cache's folder name)

    def describe(self) -> str:
        if self.repo_id is None:
            return str(self.path)
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{rev} (snapshot {self.commit[:12] if self.commit else '?'}, {self.path})"


def is_repo_id(spec: str) -> bool:
    return bool(_REPO_ID.match(spec))


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _ways_forward() -> str:
    return ("Ways forward:\n"
            "  checkpoint=<dir or repo id>   a local checkpoint directory (model.safetensors + config.json), or a "
            "Hugging Face repo id\n"
            "                                (revision=<branch, tag or commit>; a download needs the network and, for a "
            "gated repo, `hf auth login`)\n"
            "  model.weights=random          the full architecture with random weights, for speed measurements "
            "only (its output is noise)")


def resolve_checkpoint(spec: str, revision: str | None = None) -> CheckpointSource:
    """`spec` -> a local checkpoint directory. An existing directory is used as it is; a repo id is taken
    from the hub cache, downloading what is missing (unless HF_HUB_OFFLINE is set). Raises
    CheckpointNotFound with what was looked for, where, and the ways forward."""
    local = Path(spec).expanduser()
    if local.is_dir():
        if revision:
            raise ValueError(f"revision={revision} applies to a Hugging Face repo id, but checkpoint={spec} is a "
                             "local directory")
        return CheckpointSource(local.resolve())
    if not is_repo_id(spec):
        raise CheckpointNotFound(f"checkpoint={spec}: no such directory, and not a Hugging Face repo id "
                                 f"(<owner>/<name>).\n{_ways_forward()}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"the Hugging Face cache {cache_dir()}" + (" (HF_HUB_OFFLINE is set: the hub was not asked)"
                                                       if offline() else " and the hub")
    wanted = f"{spec}" + (f" at revision {revision}" if revision else "")
    try:
        path = Path(snapshot_download(spec, revision=revision, ignore_patterns=IGNORE_PATTERNS))
    except LocalEntryNotFoundError as e:
        reason = ("HF_HUB_OFFLINE is set, so the hub was not asked" if offline() else
                  f"the hub could not be reached: {_first_line(e)}")
        raise CheckpointNotFound(f"no checkpoint {wanted}: it is not in the Hugging Face cache {cache_dir()}, and "
                                 f"{reason}.\n{_ways_forward()}") from None
    except GatedRepoError:
        raise CheckpointNotFound(f"checkpoint {wanted} is gated: accept its licence on huggingface.co and log in "
                                 f"(`hf auth login` or HF_TOKEN).\n{_ways_forward()}") from None
    except RevisionNotFoundError:
        raise CheckpointNotFound(f"checkpoint {spec} has no revision {revision!r} on the hub.\n{_ways_forward()}") \
            from None
    except RepositoryNotFoundError:
        raise CheckpointNotFound(f"no repository {spec} on the hub (or it is private and no token was given); "
                                 f"looked in {where}.\n{_ways_forward()}") from None
    except (HfHubHTTPError, OSError) as e:
        raise CheckpointNotFound(f"checkpoint {wanted} could not be fetched: {_first_line(e)}; looked in "
                                 f"{where}.\n{_ways_forward()}") from None
    return CheckpointSource(path, spec, revision, path.name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def find_file(name: str, base: Path, ref: str, revision: str | None = None) -> Path | None:
    """A file `name` of the companion model `ref` (the checkpoint's `pretrained_llm`): `<base>/<ref>/<name>`
    when that directory exists, else `ref` as a repo id through the hub (cache first; the network when
    allowed). None when it is nowhere."""
    local = (base / ref / name) if not Path(ref).is_absolute() else Path(ref) / name
    if local.is_file():
        return local
    if local.parent.is_dir() or not is_repo_id(ref):
        return None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(hf_hub_download(ref, name, revision=revision))
    except (HfHubHTTPError, OSError, ValueError):   # not cached and not reachable, gated, no such file
        return None


def describe_search(name: str, base: Path, ref: str) -> str:
    """Where find_file looked, for an error message."""
    places = [str(base / ref / name)]
    if is_repo_id(ref):
        places.append(f"{ref}/{name} in {cache_dir()}" + ("" if offline() else " and on the hub"))
    return " and ".join(places)
