"""Mixture-of-experts layers traced as a capacity-padded dispatch, and the experts' feed-forward op."""
