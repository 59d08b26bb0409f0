"""Model folders shipped with chatcore (ordinary Hugging Face folders)."""
