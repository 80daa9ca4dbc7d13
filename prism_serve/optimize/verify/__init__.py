"""Verification: the egglog algebra, equivalence proofs and the numeric check."""
