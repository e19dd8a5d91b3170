"""RL tasks written as envs (`together_train_cookbook.rl.Env`) for the RL loop (`rl.train.run`)."""
