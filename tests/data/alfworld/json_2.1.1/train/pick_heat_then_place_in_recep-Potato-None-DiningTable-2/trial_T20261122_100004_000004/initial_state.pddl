(define (problem plan_trial_T20261122_100004_000004)
    (:domain alfred)
    (:objects
        agent1 - agent
        PotatoType - otype
        FridgeType - rtype
        MicrowaveType - rtype
        DiningTableType - rtype
        Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02 - object
        Fridge_bar__minus_00_dot_24_bar__plus_00_dot_00_bar__plus_01_dot_03 - receptacle
        Microwave_bar__minus_01_dot_99_bar__plus_01_dot_50_bar__minus_02_dot_48 - receptacle
        DiningTable_bar__plus_01_dot_05_bar__plus_00_dot_00_bar__plus_00_dot_54 - receptacle
        loc_bar__minus_1_bar_1_bar_0_bar_30 - location
        loc_bar__minus_6_bar__minus_9_bar_2_bar_0 - location
        loc_bar_3_bar_2_bar_1_bar_45 - location
        loc_bar_1_bar__minus_2_bar_3_bar_30 - location
        )
    (:init
        (receptacleType Fridge_bar__minus_00_dot_24_bar__plus_00_dot_00_bar__plus_01_dot_03 FridgeType)
        (receptacleType Microwave_bar__minus_01_dot_99_bar__plus_01_dot_50_bar__minus_02_dot_48 MicrowaveType)
        (receptacleType DiningTable_bar__plus_01_dot_05_bar__plus_00_dot_00_bar__plus_00_dot_54 DiningTableType)
        (objectType Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02 PotatoType)
        (canContain FridgeType PotatoType)
        (canContain MicrowaveType PotatoType)
        (canContain DiningTableType PotatoType)
        (openable Fridge_bar__minus_00_dot_24_bar__plus_00_dot_00_bar__plus_01_dot_03)
        (openable Microwave_bar__minus_01_dot_99_bar__plus_01_dot_50_bar__minus_02_dot_48)
        (pickupable Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (cleanable Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (heatable Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (coolable Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (sliceable Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (isCool Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02)
        (atLocation agent1 loc_bar_1_bar__minus_2_bar_3_bar_30)
        (receptacleAtLocation Fridge_bar__minus_00_dot_24_bar__plus_00_dot_00_bar__plus_01_dot_03 loc_bar__minus_1_bar_1_bar_0_bar_30)
        (receptacleAtLocation Microwave_bar__minus_01_dot_99_bar__plus_01_dot_50_bar__minus_02_dot_48 loc_bar__minus_6_bar__minus_9_bar_2_bar_0)
        (receptacleAtLocation DiningTable_bar__plus_01_dot_05_bar__plus_00_dot_00_bar__plus_00_dot_54 loc_bar_3_bar_2_bar_1_bar_45)
        (inReceptacle Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02 Fridge_bar__minus_00_dot_24_bar__plus_00_dot_00_bar__plus_01_dot_03)
        (objectAtLocation Potato_bar__minus_00_dot_21_bar__plus_01_dot_45_bar__plus_01_dot_02 loc_bar__minus_1_bar_1_bar_0_bar_30)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (heatable ?o)
                        (objectType ?o PotatoType)
                        (receptacleType ?r DiningTableType)
                        (isHot ?o)
                        (inReceptacle ?o ?r)
                    )
                )
            )
        )
    )
)
