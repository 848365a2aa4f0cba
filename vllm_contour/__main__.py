from vllm_contour.cli import main

if __name__ == "__main__":
    main()
