"""FlashKDA forward v2: a prepare kernel (K1) and a recurrence kernel (K2) in Triton Gluon, 16-token chunks."""
