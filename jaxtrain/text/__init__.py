"""The formats text takes on its way to and from a model, shared by preparation (jaxtrain/prepare/),
training and sampling (jaxtrain/run/) and export (jaxtrain/hf/): token and loss-mask files and
their manifest (format.py), and a tokenizer's chat template (chat_template.py). Imports nothing of
training. Tokenizers themselves are jaxtrain/tokenizer.py."""
