"""EAGLE-3 drafters (Li et al. 2025, SafeAILab/EAGLE): one decoder layer on the backbone's
low, mid and high features, trained by training-time test. `heads` holds the parameters and
the forward pass, `formats` the published checkpoint layout."""
