"""``freescale train``: the reference model trained end to end, baseline and FreeScale."""
