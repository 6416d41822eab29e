"""nemo-duplex: serving NVIDIA NemotronLabs VoiceChat-11B, many live calls per GPU."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]   # the checkout: conf/, outputs/ (run outputs, caches), eval/clips/
