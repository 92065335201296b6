"""The special tokens and the batch-width rounding that the data pipeline and the model share."""

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD_ID, CLS_ID, MASK_ID = 0, 2, 4  # their positions in SPECIAL_TOKENS
PAD_MULTIPLE = 32  # batch widths are rounded up to a multiple of this: a few shapes keep oneDNN's caches warm


def round_width(width: int) -> int:
    """`width` rounded up to a multiple of PAD_MULTIPLE."""
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE
