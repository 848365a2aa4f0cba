from vllm_contour.integration.frontend.cli import main

if __name__ == "__main__":
    main()
