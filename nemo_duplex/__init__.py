"""nemo-duplex: serving NVIDIA NemotronLabs VoiceChat-11B, many live calls per GPU."""
