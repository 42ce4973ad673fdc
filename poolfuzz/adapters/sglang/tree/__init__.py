"""SGLang's prefix trees, built as the release's registry builds them for a server's scheduler."""
