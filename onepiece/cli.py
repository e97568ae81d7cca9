def main() -> None:
    print("onepiece")
