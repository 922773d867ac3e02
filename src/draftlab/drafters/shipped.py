"""Designed drafts that ship inside draftlab: one per embedded target, pinned by SHA256.

`--drafter designed` selects the draft shipped for the target (today: the
feature draft of `scripts/build-draft.sh` for `smollm2-135m`). Every file of
the draft directory is hashed at load and compared with the values pinned
here, so a damaged or modified file is refused with a clear error instead of
silently drafting worse (or differently) than the records say.
"""

from __future__ import annotations

from pathlib import Path

from draftlab.errors import DraftlabError

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"

# target short name -> {file in its draft directory: SHA256}
SHIPPED: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "draftlab_draft.json": "92f2fca9d2c6cadb492a389b458e89646a29caa10bf7f20d51c902952b9d4829",
        "weights.safetensors": "568df900afdabf25f98f0f90a0d6e9b96913cca237a0374bbe447dc025a65b9b",
    },
}


def shipped_draft(target_name: str) -> Path:
    """The checked directory of the draft shipped for `target_name`."""
    if target_name not in SHIPPED:
        raise DraftlabError(
            f"no designed draft ships for target {target_name!r} (drafts ship for: {', '.join(sorted(SHIPPED))}, "
            "loaded by those short names); build one with `draftlab design feature` and use --drafter model:DIR"
        )
    directory = DRAFTS_DIR / target_name
    check_files(directory, SHIPPED[target_name])
    return directory


def check_files(directory: Path, manifest: dict[str, str]) -> None:
    """Raise unless every file of `manifest` exists in `directory` with its pinned SHA256."""
    from draftlab.assets import sha256_file

    for name, expected in manifest.items():
        path = directory / name
        if not path.is_file():
            raise DraftlabError(f"shipped draft file missing: {path}; reinstall draftlab or run scripts/build-draft.sh")
        digest = sha256_file(path)
        if digest != expected:
            raise DraftlabError(
                f"shipped draft file {path} has SHA256 {digest}, expected {expected}: the file was modified or "
                "damaged; restore it (git checkout / reinstall draftlab)"
            )
