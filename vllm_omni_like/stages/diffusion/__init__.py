"""The diffusion stage: its runtime, the own loop as a running set, rows, the step, the VAE
decode, edits and the video stream."""
