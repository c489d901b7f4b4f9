"""Dataset download, verification and conversion into the files the Rust reproductions read."""
