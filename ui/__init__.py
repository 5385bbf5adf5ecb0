"""Gradio UI: wires components to visualkv library calls; computes nothing itself."""
