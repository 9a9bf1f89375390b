"""What a run keeps on disk, and how it never loses it: `files` (atomic writes, whole lines),
`storage` (a refused write named: no space, read-only, quota), `rundir` (a run dir's config and
records; what a resume must keep), `runlock` (one job per run dir), `checkpoint` (orbax saves,
their checksums, read-only views of a checkpoint), `bucket` (gs:// and s3://: the one way to a
bucket), `mirror` (a bucket run dir's records kept locally and copied up), `remote` (Hugging Face
folders in buckets: tokenizers fetched, folders put). Knows nothing of
devices or the model's maths.
"""
