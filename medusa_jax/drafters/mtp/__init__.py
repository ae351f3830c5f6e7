"""Multi-token-prediction modules (DeepSeek-V3 style) as a drafter: parameters and forward
pass (`heads`), the drafter (`drafter`), the published layouts (`formats`)."""
