"""Image input: the MoonViT tower, patch merger and projector (`moonvit`), and preprocessing (`preprocess`)."""
