"""Designed drafts that ship inside draftlab: per embedded target, pinned by SHA256.

`--drafter designed` selects the feature draft of `scripts/build-draft.sh`
and `--drafter eagle3` the EAGLE-3 draft of `scripts/build-eagle3.sh`, both
for `smollm2-135m` today; for another target, the draft of that kind built on this machine into draftlab's cache
(`built_draft_dir`: `scripts/build-eagle3.sh --target NAME` writes it), unpinned. Every file of the draft directory is hashed at load
and compared with the values pinned here, so a damaged or modified file is
refused with a clear error instead of silently drafting worse (or
differently) than the records say.
"""

from __future__ import annotations

from pathlib import Path

from draftlab.drafters.files import RECORD
from draftlab.errors import DraftlabError
from draftlab.files import assets
from draftlab.files.assets import sha256_file

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"

# kind -> target short name -> (directory under DRAFTS_DIR, {file: SHA256})
SHIPPED: dict[str, dict[str, tuple[str, dict[str, str]]]] = {
    "designed": {
        "smollm2-135m": ("smollm2-135m", {
            "draftlab_draft.json": "92f2fca9d2c6cadb492a389b458e89646a29caa10bf7f20d51c902952b9d4829",
            "weights.safetensors": "568df900afdabf25f98f0f90a0d6e9b96913cca237a0374bbe447dc025a65b9b",
        }),
    },
    "eagle3": {
        "smollm2-135m": ("smollm2-135m-eagle3", {
            "draftlab_draft.json": "f98b9e169225e68ab415b821049f99318ada713083beb38f7e65a1b780b1f9d9",
            "weights.safetensors": "6a7866eb091d74c4b3956da0292ff9718e249cd5f6e611a41a709c3f2e070aec",
        }),
    },
}
BUILDERS = {"designed": "`draftlab design feature`", "eagle3": "`draftlab design eagle3`"}


def shipped_draft(target_name: str, kind: str = "designed") -> Path:
    """The checked directory of the draft of `kind` (designed, eagle3) shipped for `target_name`; for a target none
    ships for, the one built on this machine into draftlab's cache (`built_draft_dir`), if any."""
    drafts = SHIPPED[kind]
    if target_name not in drafts:
        built = built_draft_dir(target_name, kind)
        if (built / RECORD).is_file():
            return built
        script = f"`bash scripts/build-eagle3.sh --target {target_name}` writes it there" if kind == "eagle3" else ""
        raise DraftlabError(
            f"no {kind} draft ships for target {target_name!r} (they ship for: {', '.join(sorted(drafts)) or 'none'}, "
            f"loaded by those short names) nor was one built in {built}{' (' + script + ')' if script else ''}; "
            f"build one with {BUILDERS[kind]} and use --drafter model:DIR"
        )
    name, manifest = drafts[target_name]
    directory = DRAFTS_DIR / name
    check_files(directory, manifest)
    return directory


def built_draft_dir(target_name: str, kind: str) -> Path:
    """Where `--drafter KIND` finds the draft built on this machine for a target none ships for."""
    return assets.cache_dir() / "drafts" / f"{target_name}-{kind}"


def check_files(directory: Path, manifest: dict[str, str]) -> None:
    """Raise unless every file of `manifest` exists in `directory` with its pinned SHA256."""
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
