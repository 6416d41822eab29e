"""Composing an entry point's settings as its `@hydra.main` does (conf/<app>.yaml over its schema)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
APPS = ("serve", "run_clip", "make_checkpoint", "bench_step", "bench", "profile_step", "gate", "eval_clips")


def compose_app(app: str, overrides: list[str] | tuple[str, ...] = ()):
    """The composed config of conf/<app>.yaml with `overrides` (the command line's)."""
    from hydra import compose, initialize_config_dir

    import eval.settings
    import nemo_duplex.settings

    nemo_duplex.settings.register()
    eval.settings.register()
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return compose(app, overrides=list(overrides))
