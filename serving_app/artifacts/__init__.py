"""Content-addressed model and adapter files (docs/artifacts.md).

`blobs` (Django-free) hashes files and keeps them once by SHA-256 digest; `cache` (Django-free)
is a node's own verified copy with a disk quota; `sources` turns an upload, a node's folder, an
S3 bucket or a Hugging Face repository into an immutable `ArtifactVersion`; `fetch` is how a
node agent fetches what its instances need from the console (HTTP range requests, resumable);
`staging` is what the node agent calls before it starts an engine.
"""
