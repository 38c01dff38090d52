"""The numpy reference frontend and the framework-free demo."""
