"""What the pipeline reads about a target model from its files alone: its config, tokenizer and chat template."""
