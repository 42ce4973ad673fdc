"""SGLang's prefix trees: built as the release's registry builds them, driven, and modelled."""
