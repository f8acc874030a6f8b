"""A deployment's KV cache data type (vLLM's --kv-cache-dtype, default auto), and the engine
settings' labels, help texts and ranges as serving_app.enginespec declares them (no column
changes). Revisions recorded before this hold no kv_cache_dtype: they ran at auto, the default."""

import django.core.validators
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('serving_app', '0015_deployment_flow_control'),
    ]

    operations = [
        migrations.AddField(
            model_name='deployment',
            name='kv_cache_dtype',
            field=models.CharField(choices=[('auto', 'auto'), ('fp8', 'fp8'), ('fp8_e4m3', 'fp8_e4m3'), ('fp8_e5m2', 'fp8_e5m2')], default='auto', help_text="Data type of the KV cache. auto: the model's data type; fp8 (= fp8_e4m3) and fp8_e5m2 hold twice the tokens of a 16-bit cache.", max_length=16, verbose_name='KV cache data type (--kv-cache-dtype)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='base_port',
            field=models.PositiveIntegerField(blank=True, help_text='Fixed engine port for replica 0 (replica n: base_port + n). Empty: any free.', null=True, validators=[django.core.validators.MinValueValidator(1024), django.core.validators.MaxValueValidator(65000)], verbose_name='Base port'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='dtype',
            field=models.CharField(choices=[('auto', 'auto'), ('float32', 'float32'), ('float16', 'float16'), ('bfloat16', 'bfloat16')], default='auto', help_text="Data type of the weights and activations. auto: the base model's setting.", max_length=16, verbose_name='Data type (--dtype)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='enable_prefix_caching',
            field=models.BooleanField(default=True, help_text='Reuse the KV cache of a prompt prefix already computed.', verbose_name='Prefix caching (--enable-prefix-caching)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='gpu_memory_utilization',
            field=models.FloatField(default=0.9, help_text='The fraction of GPU memory the engine may use. On GPU nodes the placer sets it from the memory plan.', validators=[django.core.validators.MinValueValidator(0.01), django.core.validators.MaxValueValidator(1.0)], verbose_name='GPU memory utilization (--gpu-memory-utilization)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='isolation_mode',
            field=models.CharField(choices=[('dedicated', 'Dedicated GPUs'), ('shared', 'Shared GPU'), ('mig', 'MIG slice'), ('mps', 'MPS')], default='shared', help_text="How an instance shares its GPUs: whole GPUs of its own, a share of a GPU's memory, a MIG device, or an MPS share of a GPU's compute.", max_length=16, verbose_name='GPU isolation'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='max_lora_rank',
            field=models.PositiveIntegerField(default=16, help_text='The largest adapter rank a slot holds: 8, 16, 32, 64, 128, 256, 320, 512.', validators=[django.core.validators.MinValueValidator(8), django.core.validators.MaxValueValidator(512)], verbose_name='Max LoRA rank (--max-lora-rank)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='max_loras',
            field=models.PositiveIntegerField(default=4, help_text='LoRA slots: adapters one batch may use at once (their memory is reserved).', validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(64)], verbose_name='Max LoRA adapters per batch (--max-loras)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='max_model_len',
            field=models.PositiveIntegerField(blank=True, help_text="Empty: the model's max positions.", null=True, validators=[django.core.validators.MinValueValidator(16)], verbose_name='Context length (--max-model-len)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='max_num_batched_tokens',
            field=models.PositiveIntegerField(blank=True, help_text="Maximum number of tokens processed in one iteration. Empty: vLLM's default.", null=True, validators=[django.core.validators.MinValueValidator(16)], verbose_name='Max batched tokens (--max-num-batched-tokens)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='max_num_seqs',
            field=models.PositiveIntegerField(default=64, help_text='Maximum number of sequences processed in one iteration.', validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(4096)], verbose_name='Max sequences per batch (--max-num-seqs)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='mps_thread_percentage',
            field=models.PositiveIntegerField(blank=True, help_text="MPS isolation only: the share of the GPU's compute the engine may use.", null=True, validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(100)], verbose_name='MPS thread percentage (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='quantization',
            field=models.CharField(blank=True, choices=[('', 'none'), ('awq', 'AWQ'), ('gptq', 'GPTQ'), ('fp8', 'FP8'), ('bitsandbytes', 'bitsandbytes')], default='', help_text="Method used to quantize the weights. Empty: the base model's setting.", max_length=16, verbose_name='Quantization (--quantization)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='scheduling_policy',
            field=models.CharField(choices=[('fcfs', 'First come, first served'), ('priority', "Priority (from the tenant's tier)")], default='fcfs', help_text='Which waiting request the engine serves first.', max_length=16, verbose_name='Scheduling policy (--scheduling-policy)'),
        ),
        migrations.AlterField(
            model_name='deployment',
            name='tensor_parallel_size',
            field=models.PositiveIntegerField(default=1, help_text='GPUs one instance spans (tensor parallel groups).', validators=[django.core.validators.MinValueValidator(1), django.core.validators.MaxValueValidator(16)], verbose_name='Tensor parallel size (--tensor-parallel-size)'),
        ),
    ]
