"""Training the demo model: the King James Bible, a BPE tokenizer, the block-diffusion objective.

Run once (`python -m engine.training.train`); its output ships as `engine/demo_model/`. Nothing
here runs when the engine serves: it only shares the engine's model code, so what is trained is
exactly what is served.
"""
